"""How a chat completion runs and how its output is read: its tools, tool choice, logprobs
and tier as the core's plan (gateway.server.calls.terms.ChatPlan), and a tool call as a
chat message carries it."""

from __future__ import annotations

from typing import Any

from gateway.server.calls.terms import ChatPlan, call_id, unsupported
from gateway.server.calls.terms import chat_plan as plan_of
from gateway.server.llm import tools as toolcalls
from gateway.server.openai.schemas import ChatCompletionRequest


def chat_plan(body: ChatCompletionRequest, tool_format: toolcalls.ToolFormat | None = None) -> ChatPlan:
    """The call's tools, tool choice, logprobs and tier, checked against each other."""
    tools: list[dict[str, Any]] = []
    for index, tool in enumerate(body.tools or []):
        if tool.type != "function" or tool.function is None:
            raise unsupported(f"tools[{index}].type", f"tools of type {tool.type} are not supported: use function")
        tools.append({"type": "function", "function": tool.function.model_dump(by_alias=True, exclude_none=True)})
    choice = body.tool_choice
    named: str | None = None
    mode: str | None
    if isinstance(choice, str) or choice is None:
        mode = choice
    else:
        if choice.type != "function" or choice.function is None:
            raise unsupported("tool_choice.type", f"tool_choice of type {choice.type} is not supported: use function")
        mode, named = "named", choice.function.name
    return plan_of(
        tools,
        mode,
        named,
        parallel=body.parallel_tool_calls is not False,
        logprobs=bool(body.logprobs),
        top_logprobs=body.top_logprobs,
        service_tier=body.service_tier,
        tool_format=tool_format,
    )


def tool_call(request_id: str, index: int, call: toolcalls.ToolCall) -> dict[str, Any]:
    """A tool call as a chat message (or a streamed delta) carries it."""
    return {
        "id": call_id(request_id, index),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
