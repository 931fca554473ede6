"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API.

A call is mapped onto the core every LLM door shares (gateway.server.calls: its messages,
tools, sampling and stops in the gateway's terms) and becomes one ordinary durable request:
its id (`msg_<request id>`, and the `request-id` header), its Idempotency-Key, quotas,
tenant and resumption are those of every request; `api` in its record's metadata says
`messages`.

- system, and messages of text, tool_use and tool_result blocks, become chat messages
  (a tool_result one `tool` message, before the user's text; one marked is_error is
  sent to the model prefixed `Error: `); a final assistant message (a prefill for the
  model to continue) is refused: the chat template opens a new turn after it.
- tools are offered as functions (input_schema their parameters); tool_choice auto,
  any (a call forced by guided decoding), tool (that one, forced), none;
  disable_parallel_tool_use keeps the first call.
- stop_sequences are the call's stop words (the one that stopped the text is
  `stop_sequence`); temperature, top_p and top_k its sampling (temperature 0 is greedy);
  metadata.user_id its `user`.
- Streamed, Anthropic's events: message_start, ping, content_block_start/delta/stop
  (text_delta; a tool_use block's input in one input_json_delta, as a call is read
  whole), message_delta (stop reason and usage, cumulative: the input tokens split into
  those read from the prefix cache and the rest), message_stop. message_start carries the
  prompt's tokens as the accept stage counted them (the request's payload in Redis; its
  record's usage once it ended), none of them known to be cached yet. A request that fails
  mid-stream ends the stream with an `error` event; a client that goes away cancels it.
- The key comes as `x-api-key` (or `Authorization: Bearer`); `anthropic-version`, when
  sent, must be a date from 2023-06-01 on (the `anthropic` package sends its own);
  `anthropic-beta` is not read: what a beta adds to the body is served, or accepted and
  ignored, or refused by name, as any field. Errors are Anthropic's body
  (gateway.server.anthropic.errors); a prompt over the model's context is Anthropic's
  `prompt is too long: N tokens > M maximum`.
- A client's optional asks that only ask for more than these models have (IGNORED: thinking,
  output_config.effort, context_management's clear_thinking edits, speed, diagnostics,
  deferred tools, tools' strict and streaming hints) are accepted: the call is served
  without them (no thinking block) and the answer's `Warning` header names them. What would
  change a correct answer (sampling and stops the engine cannot apply, other context edits,
  output formats) is still refused by name.
- max_tokens above the model's room is served up to the room: a message the context cut
  stops with `model_context_window_exceeded`, one max_tokens (or the model's output cap)
  cut with `max_tokens`."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sse_starlette import ServerSentEvent

from gateway.protocol import ResultRecord, State
from gateway.server.anthropic.schemas import ContentBlock, CountTokensRequest, MessagesRequest
from gateway.server.api.errors import ApiError, validation_message
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.calls import requests as call_requests
from gateway.server.calls import run, terms
from gateway.server.calls.requests import LlmCall
from gateway.server.calls.terms import ChatPlan, invalid, refuse_unsupported, unsupported, warning
from gateway.server.llm import tools as toolcalls
from gateway.server.models import InvalidInput, ModelAdapter
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.server.services import Services, services

# anthropic-version: a date, 2023-06-01 (the Messages API's first) or later. Later versions
# add fields and parameters; the answers keep the shapes every version reads, and a
# parameter a version adds is refused by name like any other not served.
FIRST_VERSION = "2023-06-01"
VERSION_HEADER = "anthropic-version"
_DATE = re.compile(r"\d{4}-\d{2}-\d{2}")
API_LABEL = "messages"


def anthropic_version(request: Request) -> str:
    """The call's anthropic-version (2023-06-01 where none is sent); one that is not a date
    from 2023-06-01 on is refused."""
    version = request.headers.get(VERSION_HEADER)
    if version is None:
        return FIRST_VERSION
    if not _DATE.fullmatch(version) or version < FIRST_VERSION:
        raise ApiError(
            400,
            "invalid_anthropic_version",
            f"{VERSION_HEADER}: {version!r} is not a version this API speaks: use {FIRST_VERSION} or later",
        )
    return version


router = APIRouter(prefix="/v1", tags=["Anthropic"], dependencies=[Depends(anthropic_version)])


def _text_of(blocks: list[ContentBlock], where: str) -> str:
    """The text of a list of blocks that may hold text only."""
    parts = []
    for index, block in enumerate(blocks):
        if block.type != "text":
            raise unsupported(
                f"{where}[{index}].type", f"content blocks of type {block.type} are not supported here: text only"
            )
        if block.text is None:
            raise invalid(f"{where}[{index}].text", "a text block needs its text")
        parts.append(block.text)
    return "\n".join(parts)


# Blocks of an earlier answer that a model without reasoning never reads (Anthropic's API
# drops earlier turns' thinking from the prompt too).
THINKING_BLOCKS = ("thinking", "redacted_thinking")


def _message(role: str, blocks: list[ContentBlock], where: str) -> list[dict[str, Any]]:
    """The chat messages of one Anthropic message made of blocks."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for index, block in enumerate(blocks):
        param = f"{where}.content[{index}]"
        if block.type in THINKING_BLOCKS and role == "assistant":
            continue
        if role == "system" and block.type != "text":
            raise unsupported(f"{param}.type", f"a system message holds text blocks, not {block.type}")
        if block.type == "text":
            if block.text is None:
                raise invalid(f"{param}.text", "a text block needs its text")
            texts.append(block.text)
        elif block.type == "tool_use":
            if role != "assistant":
                raise invalid(f"{param}.type", "tool_use blocks are the assistant's")
            if block.id is None or block.name is None:
                raise invalid(param, "a tool_use block needs its id and name")
            arguments = json.dumps(block.input or {}, ensure_ascii=False)
            calls.append({"id": block.id, "type": "function", "function": {"name": block.name, "arguments": arguments}})
        elif block.type == "tool_result":
            if role != "user":
                raise invalid(f"{param}.type", "tool_result blocks are the user's")
            if block.tool_use_id is None:
                raise invalid(f"{param}.tool_use_id", "a tool_result block needs the tool_use_id it answers")
            content = block.content if isinstance(block.content, str) else None
            if isinstance(block.content, list):
                content = _text_of(block.content, f"{param}.content")
            text = content or ""
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": f"Error: {text}" if block.is_error else text,
                }
            )
        else:
            raise unsupported(
                f"{param}.type",
                f"content blocks of type {block.type} are not supported: these models read text "
                "(text, tool_use and tool_result blocks)",
            )
    text = "\n".join(texts)
    if role == "system":
        return [{"role": "system", "content": text}] if text else []
    if role == "assistant":
        if not text and not calls:
            raise invalid(f"{where}.content", "an assistant message needs text or tool_use blocks")
        return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]
    if not text and not results:
        raise invalid(f"{where}.content", "a user message needs text or tool_result blocks")
    return [*results, *([{"role": "user", "content": text}] if text else [])]


def chat_messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    if body.system is not None:
        system = body.system if isinstance(body.system, str) else _text_of(body.system, "system")
        if system:
            found.append({"role": "system", "content": system})
    for index, message in enumerate(body.messages):
        where = f"messages[{index}]"
        if isinstance(message.content, str):
            found.append({"role": message.role, "content": message.content})
        else:
            found += _message(message.role, message.content, where)
    spoken = [index for index, message in enumerate(body.messages) if message.role != "system"]
    if not spoken:
        raise invalid("messages", "the messages need a user message, not system text alone")
    if body.messages[spoken[-1]].role == "assistant":
        raise unsupported(
            f"messages[{spoken[-1]}].role",
            "a final assistant message (a prefill to continue) is not supported: the chat template opens a new "
            "turn after it; end with a user message",
        )
    return found


# Context edits that only clear thinking (there is none to clear).
_CLEARS_THINKING = "clear_thinking_"


def ignored(body: CountTokensRequest) -> list[str]:
    """The optional asks of a call that are accepted and not applied (the README's table),
    as the Warning header names them; what is refused is checked by call_of."""
    found = []
    if body.thinking is not None and body.thinking.type != "disabled":
        found.append("thinking")
    if body.output_config is not None and body.output_config.effort is not None:
        found.append("output_config.effort")
    if body.context_management is not None and body.context_management.edits:
        found.append("context_management")
    if any(tool.defer_loading for tool in body.tools or []):
        found.append("tools.defer_loading")
    if any(tool.strict or tool.eager_input_streaming or tool.input_examples for tool in body.tools or []):
        found.append("tools.strict")
    if isinstance(body, MessagesRequest):
        found += [name for name in ("speed", "diagnostics") if getattr(body, name) is not None]
    return found


def call_of(body: CountTokensRequest, svc: Services, seed_key: str | None = None) -> tuple[LlmCall, ModelAdapter]:
    """The core's call an Anthropic call is, and the model it names."""
    found = chat_messages(body)  # (blocks by their type first)
    for index, edit in enumerate(body.context_management.edits or [] if body.context_management else []):
        if not edit.type.startswith(_CLEARS_THINKING):
            raise unsupported(
                f"context_management.edits[{index}].type",
                f"context edits of type {edit.type} are not supported: they would change the prompt the model "
                "reads (edits that clear thinking are accepted: these models do not reason)",
            )
    refuse_unsupported(body)
    tools = []
    for index, tool in enumerate(body.tools or []):
        if tool.defer_loading:
            continue  # found by a tool search these models do not run: not offered
        if tool.type not in (None, "custom"):
            raise unsupported(
                f"tools[{index}].type",
                f"tools of type {tool.type} (Anthropic's server tools) are not supported: give client tools "
                "(name, description, input_schema)",
            )
        if tool.input_schema is None:
            raise invalid(f"tools[{index}].input_schema", "a tool needs its input_schema")
        function = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    choice = body.tool_choice
    mode: str | None = None
    named: str | None = None
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise invalid("tool_choice.name", "tool_choice of type tool names the tool")
            mode, named = "named", choice.name
        else:
            mode = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    labels = {"api": API_LABEL}
    sampling: dict[str, Any] = {}
    stops: list[str] = []
    if isinstance(body, MessagesRequest):
        sampling = {name: getattr(body, name) for name in ("temperature", "top_p", "top_k")}
        stops = list(body.stop_sequences or [])
        if body.metadata is not None and body.metadata.user_id:
            labels["user"] = _user(body.metadata.user_id)
    try:  # the messages as a chat body's are read (what Anthropic's body allows and a chat body does not)
        conversation = terms.Conversation.model_validate({"messages": found})
    except ValidationError as exc:
        raise ApiError(400, "invalid_request", validation_message(list(exc.errors()))) from None
    adapter = call_requests.llm(svc, body.model, chat=True)
    tool_format = call_requests.tool_format(svc, body.model)
    plan = terms.chat_plan(tools, mode, named, parallel=parallel, tool_format=tool_format)
    call = LlmCall(
        model=body.model,
        messages=terms.messages(conversation.messages),
        max_tokens=body.max_tokens if isinstance(body, MessagesRequest) else 1,
        stop_words=stops,
        plan=plan,
        sampling=sampling,
        seeds=call_requests.seeds(None, 1, seed_key),
        stream=bool(body.stream) if isinstance(body, MessagesRequest) else False,
        labels=labels,
    )
    return call, adapter


def _user(user_id: str) -> str:
    """metadata.user_id as the records' `user` (256 characters at most, as a chat body's): a longer one
    (Claude Code's JSON of ids) by its digest, so the same user is still the same."""
    if len(user_id) <= 256:
        return user_id
    return "sha256:" + hashlib.sha256(user_id.encode()).hexdigest()


# -- answers --------------------------------------------------------------------------------


def tool_use_id(request_id: str, index: int) -> str:
    """A tool_use block's id: stable for the request (the stream and the record agree)."""
    return "toolu_" + terms.call_id(request_id, index).removeprefix("call_")


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's input object (a call cut by max_tokens, not valid JSON: {})."""
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def stop_of(record: ResultRecord, called: bool, context_length: int | None = None) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished request: one cut where the
    prompt and the answer filled the model's context is model_context_window_exceeded."""
    if run.finish_reason(record) == "length":
        usage = record.usage
        if context_length and usage and usage.prompt_tokens + usage.completion_tokens >= context_length:
            return "model_context_window_exceeded", None
        return "max_tokens", None  # (a call cut by max_tokens too)
    if called:
        return "tool_use", None
    sequence = (record.outputs or {}).get("stop_sequence")
    return ("stop_sequence", str(sequence)) if sequence else ("end_turn", None)


def usage_of(record: ResultRecord, tpb: int) -> dict[str, Any]:
    """Anthropic's usage: input_tokens are those not read from the prefix cache."""
    prompt = record.usage.prompt_tokens if record.usage else 0
    cached = run.cached_tokens(record, tpb)
    return {
        "input_tokens": prompt - cached,
        "output_tokens": record.usage.completion_tokens if record.usage else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "service_tier": "standard",
    }


def message_of(
    record: ResultRecord, model: str, plan: ChatPlan, tpb: int, context_length: int | None = None
) -> dict[str, Any]:
    content, calls = terms.read_calls((record.outputs or {}).get("text_output", ""), plan)
    calls = calls if plan.parallel else calls[:1]
    blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
    for index, call in enumerate(calls):
        blocks.append(
            {
                "type": "tool_use",
                "id": tool_use_id(record.request_id, index),
                "name": call.name,
                "input": tool_input(call.arguments),
            }
        )
    stop_reason, stop_sequence = stop_of(record, bool(calls), context_length)
    return {
        "id": f"msg_{record.request_id}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": usage_of(record, tpb),
    }


@router.post("/messages", summary="Create a message (Anthropic)")
async def create_message(body: MessagesRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    svc = services(request)
    call, adapter = call_of(body, svc, run.idempotency_key(request))
    natives = call_requests.requests(call, adapter, svc)
    if body.stream:  # a stream past the tenant's share of followers: refused before anything is queued
        svc.events.admissible(who.tenant)
    submission = await run.submit(svc, who, request, natives)
    request_id = submission.request_id
    headers = {"x-request-id": request_id, "request-id": request_id, **warning(ignored(body))}
    tpb = call_requests.tokens_per_block(svc, body.model)
    plan = call.plan
    context_length = call_requests.context_length(svc, body.model)
    if body.stream:
        stream = MessageStream(request_id, body.model, plan, tpb, context_length)
        counted = submission.prompt_tokens[0] if submission.prompt_tokens else None
        return EventStream(
            stream.events(svc, who.tenant, who.scope, counted), ping=svc.settings.sse_ping_s, headers=headers
        )
    timeout = natives[0].timeout_s or svc.settings.default_timeout_s
    record = await run.wait_record(svc, who, request_id, timeout)
    run.raise_for_record(record)
    return JSONResponse(message_of(record, body.model, plan, tpb, context_length), headers=headers)


@router.post("/messages/count_tokens", summary="Count a message's tokens (Anthropic)")
async def count_tokens(
    body: CountTokensRequest, request: Request, who: Annotated[Caller, Depends(caller)]
) -> dict[str, int]:
    """The prompt's tokens as the model reads it (its chat template, the tools offered):
    what the call's input_tokens would be before the prefix cache. Nothing runs, but the
    tokenizer does: the call counts as a request against the tenant's requests per minute."""
    svc = services(request)
    call, adapter = call_of(body, svc)
    native = call_requests.requests(call, adapter, svc)[0]
    who.headers |= await svc.quotas.admit(who.config, 0)

    def count() -> int:
        return adapter.prompt_tokens(adapter.validate(native.inputs, native.parameters)) or 0

    try:
        tokens = await off_the_loop_if_long(native.inputs, count, tenant=who.tenant)
    except InvalidInput as exc:
        details = exc.details if isinstance(exc.details, dict) else {}
        if exc.code == "prompt_too_long" and isinstance(details.get("prompt_tokens"), int):
            return {"input_tokens": details["prompt_tokens"]}  # counted, if too long to run
        raise ApiError(400, exc.code, exc.message) from None
    return {"input_tokens": tokens}


# -- streaming --------------------------------------------------------------------------------


async def prompt_tokens(svc: Services, request_id: str, scope: str | None) -> int:
    """The prompt's tokens as the accept stage of the call that made it counted them (a
    replay's): in the request's payload
    while it waits or runs, in its record's usage once it ended (FINISH empties the payload;
    an idempotent replay may name a request long ended)."""
    job = await svc.results.job(request_id, scope)
    counted = job.payload.get("prompt_tokens") if job is not None else None
    if isinstance(counted, int):
        return counted
    outcome = await svc.results.get(request_id, scope)
    usage = outcome.usage if isinstance(outcome, ResultRecord) else None
    return usage.prompt_tokens if usage is not None else 0


def _event(kind: str, data: dict[str, Any]) -> ServerSentEvent:
    return ServerSentEvent(event=kind, data=json.dumps({"type": kind, **data}, ensure_ascii=False))


class MessageStream:
    """Anthropic's events of a streamed message, from its request's events."""

    def __init__(
        self, request_id: str, model: str, plan: ChatPlan, tpb: int, context_length: int | None = None
    ) -> None:
        self.request_id = request_id
        self.context_length = context_length
        self.model = model
        self.plan = plan
        self.tpb = tpb
        self.parser = (
            toolcalls.StreamParser(plan.tool_format, tools=plan.tools) if plan.tools and not plan.forced else None
        )
        self.held = ""  # a forced call's text, read whole at the end
        self.blocks = 0  # content blocks started
        self.text_open = False  # the last block started is a text block not stopped yet
        self.calls = 0

    def _stop_text(self) -> list[ServerSentEvent]:
        if not self.text_open:
            return []
        self.text_open = False
        return [_event("content_block_stop", {"index": self.blocks - 1})]

    def _text(self, text: str) -> list[ServerSentEvent]:
        if not text:
            return []
        events = []
        if not self.text_open:
            events.append(
                _event("content_block_start", {"index": self.blocks, "content_block": {"type": "text", "text": ""}})
            )
            self.blocks += 1
            self.text_open = True
        events.append(
            _event("content_block_delta", {"index": self.blocks - 1, "delta": {"type": "text_delta", "text": text}})
        )
        return events

    def _call(self, call: toolcalls.ToolCall) -> list[ServerSentEvent]:
        if not self.plan.parallel and self.calls:
            return []
        events = self._stop_text()
        index = self.blocks
        block = {"type": "tool_use", "id": tool_use_id(self.request_id, self.calls), "name": call.name, "input": {}}
        partial = json.dumps(tool_input(call.arguments), ensure_ascii=False)
        events += [
            _event("content_block_start", {"index": index, "content_block": block}),
            _event(
                "content_block_delta", {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}}
            ),
            _event("content_block_stop", {"index": index}),
        ]
        self.blocks += 1
        self.calls += 1
        return events

    def _items(self, items: list[str | toolcalls.ToolCall]) -> list[ServerSentEvent]:
        events: list[ServerSentEvent] = []
        for item in items:
            events += self._text(item) if isinstance(item, str) else self._call(item)
        return events

    def on_token(self, text: str) -> list[ServerSentEvent]:
        if self.plan.forced:
            self.held += text
            return []
        if self.parser is not None:
            return self._items(self.parser.feed(text))
        return self._text(text)

    def on_end(self, record: ResultRecord) -> list[ServerSentEvent]:
        events: list[ServerSentEvent] = []
        if self.parser is not None:
            events += self._items(self.parser.finish())
        if self.plan.forced:
            _, calls = terms.read_calls(self.held, self.plan)
            events += self._items([*calls])
        events += self._stop_text()
        stop_reason, stop_sequence = stop_of(record, self.calls > 0, self.context_length)
        usage = usage_of(record, self.tpb)
        usage.pop("service_tier")
        events.append(
            _event(
                "message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage}
            )
        )
        events.append(_event("message_stop", {}))
        return events

    async def events(
        self, svc: Services, tenant: str, scope: str | None, counted: int | None = None
    ) -> AsyncIterator[ServerSentEvent]:
        """The stream, followed for `tenant` (the caller's); `counted`: the prompt's tokens
        as this call's accept stage counted them (else they are read back: an idempotent
        replay's)."""
        usage = {
            "input_tokens": counted if counted is not None else await prompt_tokens(svc, self.request_id, scope),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 0,
        }
        start: dict[str, Any] = {
            "id": f"msg_{self.request_id}",
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage,
        }
        yield _event("message_start", {"message": start})
        yield _event("ping", {})
        async for _, event in run.follow_all(svc, [self.request_id], tenant):
            if event.kind == "token":
                for item in self.on_token(run.token_text(event)):
                    yield item
            elif event.terminal:
                record = run.record_of(event)
                if record.status != State.SUCCEEDED:
                    message = record.error.message if record.error else f"the request was {record.status.value}"
                    code = record.error.code if record.error else record.status.value
                    error = {"type": "api_error", "message": message, "code": code}
                    yield _event("error", {"error": error})
                    return
                for item in self.on_end(record):
                    yield item
                return
