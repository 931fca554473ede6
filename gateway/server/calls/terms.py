"""A call in the gateway's terms, whichever API it came by: the fields of a body (each
honoured or refused by name; a Warning header naming those accepted and not applied), the
chat messages as the engine adapter takes them, the tier it runs in, and its plan (the
tools offered, a forced call, how the output is read)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.server.api.errors import ApiError
from gateway.server.llm import tools as toolcalls
from gateway.server.models.inputs import MAX_TEXT_CHARS

# -- fields ---------------------------------------------------------------------------------

Text = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
Stop = Annotated[str, StringConstraints(min_length=1, max_length=256)]
FunctionName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
# Stop sequences a call may give (the engines take 16 words).
MAX_STOP = 16

# Why a field is refused, whichever API's body holds it (a door adds its own).
UNSUPPORTED: dict[str, str] = {
    "logit_bias": "logit_bias is not supported",
    "moderation": "moderation is not supported: this gateway runs no moderation model",
    "prompt_cache_retention": "prompt_cache_retention other than in_memory is not supported: the engines' "
    "prefix caches live in memory",
    "reasoning_effort": "reasoning_effort is not supported: these are not reasoning models",
    "verbosity": "verbosity is not supported",
}
# Values of refused fields that ask for nothing (what the gateway does anyway).
NEUTRAL: dict[str, tuple[Any, ...]] = {"prompt_cache_retention": ("in_memory", "in-memory")}


class Body(BaseModel):
    """A request object: known fields typed strictly, unknown ones kept for
    refuse_unsupported."""

    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)


def _neutral(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def refuse_unsupported(
    body: BaseModel,
    reasons: dict[str, str] | None = None,
    neutral: dict[str, tuple[Any, ...]] | None = None,
    path: str = "",
) -> None:
    """400 unsupported_parameter for the first field, at any depth, set to something other
    than a neutral value (null, false, an empty list or object, or a value `neutral` names
    for a top-level field); `reasons` (beside UNSUPPORTED) say why a top-level field is
    refused, any other is not a parameter of the endpoint."""
    reasons = {**UNSUPPORTED, **(reasons or {})}
    neutral = {**NEUTRAL, **(neutral or {})}
    for name, value in (body.model_extra or {}).items():
        allowed = neutral.get(name) if not path else None
        if value is None or (value in allowed if allowed is not None else _neutral(value)):
            continue
        param = f"{path}{name}"
        reason = reasons.get(name) if not path else None
        message = reason or f"{param} is not a parameter of this endpoint"
        raise ApiError(400, "unsupported_parameter", message, details={"param": param})
    for name in type(body).model_fields:
        value = getattr(body, name)
        if isinstance(value, BaseModel):
            refuse_unsupported(value, reasons, neutral, f"{path}{name}.")
        elif isinstance(value, list):
            for index, item in enumerate(value):
                if isinstance(item, BaseModel):
                    refuse_unsupported(item, reasons, neutral, f"{path}{name}[{index}].")


def unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, "unsupported_parameter", message, details={"param": param})


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", details={"param": param})


def warning(names: list[str]) -> dict[str, str]:
    """RFC 9111's Warning header (299: a persistent warning) naming what was not applied."""
    if not names:
        return {}
    return {"warning": f'299 - "accepted and not applied: {", ".join(names)} (these models do not reason)"'}


# -- messages -------------------------------------------------------------------------------

TEXT_PARTS = ("text", "input_text", "output_text")
# Chat messages a call may hold.
MAX_MESSAGES = 256


class TextPart(Body):
    type: str = "text"
    text: Text | None = None  # required for a text part (messages() says so by name)


class CalledFunction(Body):
    name: FunctionName
    arguments: Text = "{}"


class ToolCall(Body):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(Body):
    """A chat message (OpenAI's chat shape, which the chat templates read)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # A string, or a list of content parts (text only: others are refused by their type).
    content: Text | list[TextPart] | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)  # assistant
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text or "" for part in self.content)
        return self.content or ""


class Conversation(Body):
    """The messages a door made of its API's (read as a chat body's are)."""

    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)


def messages(items: list[Message]) -> list[dict[str, Any]]:
    """Chat messages as the engine adapter takes them (text content, tool calls, results);
    non-text content parts are refused by their type."""
    shaped = []
    for index, m in enumerate(items):
        if isinstance(m.content, list):
            for part_index, part in enumerate(m.content):
                if part.type not in TEXT_PARTS:
                    raise unsupported(
                        f"messages[{index}].content[{part_index}].type",
                        f"content parts of type {part.type} are not supported: these models read text",
                    )
                if part.text is None:
                    raise invalid(f"messages[{index}].content[{part_index}].text", "a text part needs its text")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            needs = "content or tool_calls" if m.role == "assistant" else "content"
            raise invalid(f"messages[{index}].content", f"a {m.role} message needs {needs}")
        if m.role == "tool" and not m.tool_call_id:
            raise invalid(f"messages[{index}].tool_call_id", "a tool message needs the tool_call_id it answers")
        item: dict[str, Any] = {"role": m.role, "content": m.text() if m.content is not None else None}
        if m.tool_calls:
            item["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            item["tool_call_id"] = m.tool_call_id
        if item["content"] is None and not m.tool_calls:
            item["content"] = ""
        shaped.append(item)
    return shaped


# -- the tier -------------------------------------------------------------------------------

# Priority runs in the high band (the native priority of this value).
PRIORITY_TIER = 5


@dataclass(frozen=True)
class Tier:
    """A service tier as run: the native priority, whether it is flex (the batch band), and
    what the answer echoes (auto and default run as default)."""

    priority: int = 0
    flex: bool = False
    name: str = "default"


DEFAULT_TIER = Tier()


def tier(value: str | None) -> Tier:
    if value in (None, "auto", "default"):
        return Tier()
    if value == "flex":
        return Tier(flex=True, name="flex")
    if value == "priority":
        return Tier(priority=PRIORITY_TIER, name="priority")
    raise unsupported("service_tier", f"service_tier {value} is not supported: use auto, default, flex or priority")


# -- the plan -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPlan:
    """How a chat call runs and how its outputs are read."""

    tools: list[dict[str, Any]] | None = None  # offered to the model
    forced: bool = False  # tool_choice required or named: the whole output is one call
    parallel: bool = True  # several calls in one answer
    logprobs: bool = False
    tier: Tier = DEFAULT_TIER
    # How the model writes calls (its chat template's family); None reads every family.
    tool_format: toolcalls.ToolFormat | None = None


def chat_plan(
    tools: list[dict[str, Any]],
    mode: str | None,
    named: str | None = None,
    *,
    parallel: bool = True,
    logprobs: bool = False,
    top_logprobs: int | None = None,
    service_tier: str | None = None,
    tool_format: toolcalls.ToolFormat | None = None,
) -> ChatPlan:
    """The plan of a call's tools ({"type": "function", "function": {...}}), tool choice
    (`mode` none, auto, required, or named with `named`; None: auto where tools are
    offered), logprobs and tier, checked against each other."""
    mode = mode or ("auto" if tools else "none")
    if mode == "named" and named not in {t["function"]["name"] for t in tools}:
        raise ApiError(
            400,
            "invalid_request",
            f"tool_choice names {named}, which is not in tools",
            details={"param": "tool_choice"},
        )
    if mode in ("required", "named") and not tools:
        raise ApiError(400, "invalid_request", "tool_choice requires tools", details={"param": "tool_choice"})
    if top_logprobs and not logprobs:
        raise ApiError(
            400, "invalid_request", "top_logprobs requires logprobs: true", details={"param": "top_logprobs"}
        )
    offered = [t for t in tools if named is None or t["function"]["name"] == named]
    return ChatPlan(
        tools=offered if mode != "none" else None,
        forced=mode in ("required", "named"),
        parallel=parallel,
        logprobs=logprobs,
        tier=tier(service_tier),
        tool_format=tool_format,
    )


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: stable for the request, so a stream and a later read agree."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def read_calls(text: str, plan: ChatPlan) -> tuple[str | None, list[toolcalls.ToolCall]]:
    """The message text and the tool calls in a choice's output."""
    if plan.forced:
        return None, [toolcalls.parse_forced(text, plan.tools)]  # cut by max_tokens: still the call
    if plan.tools:
        content, calls = toolcalls.parse(text, plan.tool_format, tools=plan.tools)
        calls = calls if plan.parallel else calls[:1]
        return (content or None) if calls else content, calls
    return text, []
