"""How a chat call runs and how its output is read: its tools, tool choice, logprobs and
tier, checked against each other (ChatPlan), and the text and tool calls of a choice's
output."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.server.api.errors import ApiError
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.schemas import ChatCompletionRequest, unsupported


@dataclass(frozen=True)
class ChatPlan:
    """How a chat call runs and how its outputs are read."""

    tools: list[dict[str, Any]] | None = None  # offered to the model
    forced: bool = False  # tool_choice required or named: the whole output is one call
    parallel: bool = True  # several calls in one answer
    logprobs: bool = False
    tier: common.Tier = common.DEFAULT_TIER
    # How the model writes calls (its chat template's family); None reads every family.
    tool_format: toolcalls.ToolFormat | None = None


def chat_plan(body: ChatCompletionRequest, tool_format: toolcalls.ToolFormat | None = None) -> ChatPlan:
    """The call's tools, tool choice, logprobs and tier, checked against each other."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function" or tool.function is None:
            raise unsupported(f"tools[{index}].type", f"tools of type {tool.type} are not supported: use function")
        tools.append({"type": "function", "function": tool.function.model_dump(by_alias=True, exclude_none=True)})
    choice = body.tool_choice
    named: str | None = None
    mode: str
    if isinstance(choice, str) or choice is None:
        mode = choice or ("auto" if tools else "none")
    else:
        if choice.type != "function" or choice.function is None:
            raise unsupported("tool_choice.type", f"tool_choice of type {choice.type} is not supported: use function")
        mode, named = "named", choice.function.name
        if named not in {t["function"]["name"] for t in tools}:
            raise ApiError(
                400,
                "invalid_request",
                f"tool_choice names {named}, which is not in tools",
                details={"param": "tool_choice"},
            )
    if mode in ("required", "named") and not tools:
        raise ApiError(400, "invalid_request", "tool_choice requires tools", details={"param": "tool_choice"})
    if body.top_logprobs and not body.logprobs:
        raise ApiError(
            400, "invalid_request", "top_logprobs requires logprobs: true", details={"param": "top_logprobs"}
        )
    offered = [t for t in tools if named is None or t["function"]["name"] == named]
    return ChatPlan(
        tools=offered if mode != "none" else None,
        forced=mode in ("required", "named"),
        parallel=body.parallel_tool_calls is not False,
        logprobs=bool(body.logprobs),
        tier=common.tier(body.service_tier),
        tool_format=tool_format,
    )


def tool_call(request_id: str, index: int, call: toolcalls.ToolCall) -> dict[str, Any]:
    """A tool call as a chat message (or a streamed delta) carries it."""
    return {
        "id": common.call_id(request_id, index),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def read_calls(text: str, plan: ChatPlan) -> tuple[str | None, list[toolcalls.ToolCall]]:
    """The message text and the tool calls in a choice's output."""
    if plan.forced:
        return None, [toolcalls.parse_forced(text, plan.tools)]  # cut by max_tokens: still the call
    if plan.tools:
        content, calls = toolcalls.parse(text, plan.tool_format, tools=plan.tools)
        calls = calls if plan.parallel else calls[:1]
        return (content or None) if calls else content, calls
    return text, []
