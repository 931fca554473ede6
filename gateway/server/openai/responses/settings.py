"""What a response was asked for (ResponseSettings, kept with a stored response), its id
and its status as the response object names them."""

import json
from typing import Any

from pydantic import BaseModel, Field

from gateway.protocol import ResultRecord, State, valid_request_id
from gateway.protocol.http import LiveStatus
from gateway.server.api.errors import ApiError
from gateway.server.calls import terms
from gateway.server.calls.terms import ChatPlan
from gateway.server.llm import tools as toolcalls

# Calls one output may hold (max_tool_calls may say fewer).
MAX_TOOL_CALLS = 128

STATUS = {
    State.QUEUED: "queued",
    State.RUNNING: "in_progress",
    State.SUCCEEDED: "completed",
    State.FAILED: "failed",
    State.EXPIRED: "failed",
    State.CANCELED: "cancelled",
}


def response_id(request_id: str) -> str:
    return f"resp_{request_id}"


def request_id_of(value: str) -> str:
    request_id = value.removeprefix("resp_")
    if not valid_request_id(request_id):
        raise ApiError(404, "not_found", f"no response {value}")
    return request_id


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", message, details={"param": param})


# -- what a response was asked for ----------------------------------------------------------


class ResponseSettings(BaseModel):
    """What a response object echoes of its request, and how its output is read (kept in
    MongoDB with a stored response)."""

    background: bool = False
    store: bool = True
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: str | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)  # as the response object shows them
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    logprobs: bool = False
    max_output_tokens: int | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str = "default"

    def plan(self, tool_format: toolcalls.ToolFormat | None) -> ChatPlan:
        """How the output is read: chat completions' plan for these tools and this choice
        (a namespace's functions offered by their qualified names)."""
        offered = [_chat_tool(tool, name) for name, tool in functions(self.tools).items()]
        choice = self.tool_choice
        forced = isinstance(choice, dict) or choice == "required"
        if isinstance(choice, dict):
            offered = [t for t in offered if t["function"]["name"] == choice.get("name")]
        return ChatPlan(
            tools=offered if offered and choice != "none" else None,
            forced=forced and bool(offered),
            parallel=self.parallel_tool_calls,
            logprobs=self.logprobs,
            tier=terms.tier(self.service_tier),
            tool_format=tool_format,
        )

    @property
    def max_calls(self) -> int:
        return 1 if not self.parallel_tool_calls else self.max_tool_calls or MAX_TOOL_CALLS


def _chat_tool(tool: dict[str, Any], name: str) -> dict[str, Any]:
    """A Responses function tool in chat completions' shape (what the templates render)."""
    function = {k: tool[k] for k in ("description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": {"name": name, **function}}


# A namespace's function as the model is offered it and calls it: `namespace.name` (OpenAI's
# model sees the namespace; a chat template sees one flat list of functions).
NAMESPACE_SEPARATOR = "."


def qualified(namespace: str | None, name: str) -> str:
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}" if namespace else name


def functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every function offered, by the name the model calls it (a namespace's qualified)."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        if tool.get("type") == "namespace":
            for inner in tool.get("tools") or []:
                found[qualified(tool["name"], inner["name"])] = inner
        else:
            found[tool["name"]] = tool
    return found


def settings_names(tools: list[dict[str, Any]]) -> list[str]:
    return list(functions(tools))


def namespaces(tools: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """A namespace's functions: the name the model calls -> (namespace, the function's name)."""
    return {
        qualified(tool["name"], inner["name"]): (tool["name"], inner["name"])
        for tool in tools
        if tool.get("type") == "namespace"
        for inner in tool.get("tools") or []
    }


# Labels the gateway keeps with a response's record (not the caller's metadata).
_OWN_LABELS = (
    "api",
    "background",
    "store",
    "service_tier",
    "text_format",
    "text_format_name",
    "user",
    "safety_identifier",
)


def _text_config(labels: dict[str, str], inputs: dict[str, Any]) -> dict[str, Any]:
    """The text format of a response kept before its settings were (from its labels)."""
    kind = labels.get("text_format")
    if kind == "json_object":
        return {"format": {"type": "json_object"}}
    if kind == "json_schema":
        guide = (inputs.get("guided_decoding") or {}).get("guide") or "{}"
        name = labels.get("text_format_name") or "response"
        return {"format": {"type": "json_schema", "name": name, "schema": json.loads(guide), "strict": True}}
    return {"format": {"type": "text"}}


def settings_of_record(outcome: ResultRecord | LiveStatus) -> ResponseSettings:
    """What a response without kept settings echoes: what its record says."""
    labels = dict(outcome.metadata)
    found = ResponseSettings(
        background=labels.get("background", "false") == "true",
        store=labels.get("store") != "false",
        metadata={k: v for k, v in labels.items() if k not in _OWN_LABELS},
        user=labels.get("user"),
        safety_identifier=labels.get("safety_identifier"),
        service_tier=labels.get("service_tier", "default"),
    )
    if isinstance(outcome, ResultRecord):
        native = outcome.parameters
        greedy = native.get("top_k") == 1 and native.get("temperature") is None  # (temperature 0: openai_sampling)
        found.text = _text_config(labels, outcome.inputs)
        found.top_logprobs = int(native.get("top_logprobs") or 0)
        found.logprobs = bool(native.get("logprobs"))
        found.temperature = 0.0 if greedy else float(native.get("temperature") or 1.0)
        found.top_p = float(native.get("top_p") or 1.0)
        found.max_output_tokens = outcome.inputs.get("max_tokens")
    return found
