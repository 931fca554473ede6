"""The response object, every field present (null where it does not apply)."""

from typing import Any

from gateway.protocol import ResultRecord, State
from gateway.protocol.http import LiveStatus
from gateway.server.calls import run
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.responses.items import (
    output_of,
)
from gateway.server.openai.responses.settings import (
    STATUS,
    ResponseSettings,
    response_id,
    settings_of_record,
)

# -- the response object ------------------------------------------------------------------------


def response_object(
    outcome: ResultRecord | LiveStatus,
    settings: ResponseSettings | None = None,
    tpb: int = 32,
    tool_format: toolcalls.ToolFormat | None = None,
    output: list[dict[str, Any]] | None = None,
    status: str | None = None,
) -> dict[str, Any]:
    """The response object of a request, every field present: its output from the record
    (or `output`, a stream's), `status` instead of the request's when given."""
    settings = settings or settings_of_record(outcome)
    found = status or STATUS[outcome.status]
    fields: dict[str, Any] = {}
    if isinstance(outcome, ResultRecord):
        fields["output"] = output if output is not None else output_of(outcome, settings, tool_format).items
        if outcome.status == State.SUCCEEDED and run.finish_reason(outcome) == "length":
            found = "incomplete"
            fields["incomplete_details"] = {"reason": "max_output_tokens"}
            made = outcome.usage.completion_tokens if outcome.usage else None
            if made and settings.max_output_tokens and made < settings.max_output_tokens:
                # Cut before the cap asked: the model's own (its context's room after the
                # prompt, or its most output tokens) applied, and this is that number.
                fields["max_output_tokens"] = made
        if found == "completed" and outcome.finished_at is not None:
            fields["completed_at"] = int(outcome.finished_at.timestamp())
        if outcome.error and outcome.status in (State.FAILED, State.EXPIRED):
            error = outcome.error
            fields["error"] = {"code": "server_error", "message": f"{error.code}: {error.message}"}
        counted = common.usage([outcome], tpb)
        fields["usage"] = {
            "input_tokens": counted["prompt_tokens"],
            "output_tokens": counted["completion_tokens"],
            "total_tokens": counted["total_tokens"],
            # (What the engines' prefix caches wrote is not reported: none is counted.)
            "input_tokens_details": {
                "cached_tokens": counted["prompt_tokens_details"]["cached_tokens"],
                "cache_write_tokens": 0,
            },
            "output_tokens_details": {"reasoning_tokens": 0},
        }
    created = int(outcome.created_at.timestamp())
    return {**blank_object(outcome.request_id, outcome.model, created, found, settings), **fields}


def blank_object(
    request_id: str, model: str, created_at: int, status: str, settings: ResponseSettings
) -> dict[str, Any]:
    """A response object before its request has ended: no output, no usage yet."""
    return {
        "id": response_id(request_id),
        "object": "response",
        "created_at": created_at,
        "completed_at": None,
        "status": status,
        "background": settings.background,
        "error": None,
        "incomplete_details": None,
        "model": model,
        "instructions": settings.instructions,
        "previous_response_id": settings.previous_response_id,
        "conversation": {"id": settings.conversation} if settings.conversation else None,
        "output": [],
        "tools": settings.tools,
        "tool_choice": settings.tool_choice,
        "parallel_tool_calls": settings.parallel_tool_calls,
        "max_tool_calls": settings.max_tool_calls,
        "max_output_tokens": settings.max_output_tokens,
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "presence_penalty": settings.presence_penalty,
        "frequency_penalty": settings.frequency_penalty,
        "top_logprobs": settings.top_logprobs,
        "text": {**settings.text, "verbosity": "medium"},
        "truncation": "disabled",
        "reasoning": None,
        "store": settings.store,
        "service_tier": settings.service_tier,
        "metadata": settings.metadata,
        "user": settings.user,
        "safety_identifier": settings.safety_identifier,
        "prompt_cache_key": settings.prompt_cache_key,
        "prompt_cache_retention": None,
        "prompt_cache_options": None,
        "prompt": None,
        "usage": None,
        # OpenAI's fields for what this gateway does not do.
        "access_programs": None,
        "image": None,
        "input_transformations": None,
        "moderation": None,
        "prompt_cache_diagnostics": None,
        "tool_usage": None,
    }
