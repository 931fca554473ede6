"""POST /v1/chat/completions and POST /v1/completions.

Messages are rendered with the model's chat template by the engine adapter (with the tools,
when the call offers some); `stream` answers with `data:` chunks then `data: [DONE]`, with a
usage chunk when stream_options.include_usage is set; a client that disconnects from a
stream cancels the generation.

- n > 1: n ordinary requests admitted together (all or none), each with its own seed (the
  call's seed + i, else random ones), their usage summed; streamed chunks carry each
  choice's index.
- logprobs / top_logprobs (engine contract): from the record's outputs.logprobs; streamed,
  a choice's log-probabilities come with its last chunk (the one with finish_reason).
- response_format json_object / json_schema: guided decoding on the engine (the output is
  valid JSON, of the schema).
- tools / tool_choice: auto offers the tools and reads the calls from the text in the
  format of the model's template family (gateway.server.llm.tools; streamed: text that may
  begin a call is held back, a call goes out whole); required or a named function forces one
  call by guided decoding (a call cut by max_tokens is still a call, finish_reason length);
  none offers no tools. A call ends the choice with finish_reason tool_calls.
- sampling: OpenAI's defaults (openai_sampling); stop sequences are matched on the text by
  the engine adapter (gateway.server.llm.stops) and left out of it.
- service_tier: flex runs in the batch band with a long deadline, priority in the high
  band; the answer says which ran (auto and default: default).
- prompt_cache_key: routing affinity (requests with the same key prefer the same replica)."""

from __future__ import annotations

import hashlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette import ServerSentEvent

from gateway.protocol import ResultRecord, State
from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.api.sse import EventStream, FrameTemplate, json_value
from gateway.server.api.tenancy import Caller, caller
from gateway.server.llm import tools as toolcalls
from gateway.server.models import ModelAdapter
from gateway.server.openai import common
from gateway.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ResponseRequest,
    Sampling,
    refuse_unsupported,
    unsupported,
)
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

# Requests behind one call at most (n, times the prompts of a completion).
MAX_CHOICES = 16


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


def _guided(response_format: ResponseFormat | None, param: str = "response_format") -> dict[str, Any] | None:
    """TensorRT-LLM's guided decoding for a response format (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"guide_type": "json_schema", "guide": json.dumps({"type": "object"})}
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    if not schema:
        raise ApiError(400, "invalid_request", "json_schema needs a schema", details={"param": f"{param}.json_schema"})
    return {"guide_type": "json_schema", "guide": json.dumps(schema)}


_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")


def parameters(body: Sampling | ResponseRequest, adapter: ModelAdapter, **extra: Any) -> dict[str, Any]:
    """The native parameters of a call; what the model's contract cannot take is refused by
    its OpenAI name."""
    found = {name: getattr(body, name, None) for name in _SAMPLING} | extra
    needs = {
        "presence_penalty": "penalties",
        "frequency_penalty": "penalties",
        "repetition_penalty": "repetition_penalty",
        "prompt_cache_key": "prompt_cache_key",
        "logprobs": "logprobs",
        "top_logprobs": "top_logprobs",
    }
    for name, feature in needs.items():
        if found.get(name) not in (None, False, 0):
            common.require(adapter, feature, name)
    found |= openai_sampling(found.get("temperature"), found.get("top_p"), found.get("top_k"))
    return {k: v for k, v in found.items() if v not in (None, False) and not (k == "top_logprobs" and v == 0)}


def openai_sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> dict[str, Any]:
    """OpenAI's sampling in the engines' terms. OpenAI samples unless told otherwise (an
    omitted temperature or top_p is 1); TensorRT-LLM's contracts search greedily unless a
    top_k above 1 or a top_p is given. So an omitted top_p is sent as 1 (the whole
    distribution: sampling at the temperature), and temperature 0 is sent as top_k 1
    (greedy on every engine, whatever it makes of a zero temperature)."""
    if temperature == 0:
        return {"temperature": None, "top_p": None, "top_k": 1}
    return {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": top_k,
    }


def seeds(seed: int | None, count: int, key: str | None = None) -> list[int | None]:
    """One seed per choice: the call's seed + i, so n choices are n distinct draws and the
    same seed repeats. Without one, the first is derived from `key` (an Idempotency-Key, a
    batch line: the same call again is the same requests), or left to the submission, which
    gives each unseeded sampled request a fresh random seed."""
    if seed is None and key:
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4])
    if seed is None:
        return [None] * count
    return [(seed + i) % 2**63 for i in range(count)]


def chat_request(body: ChatCompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a chat completion, one per choice (also for the Batch API)."""
    adapter = common.llm(svc, body.model, chat=True)
    refuse_unsupported(body, "chat")
    body.check_stream_options()
    plan = chat_plan(body)
    inputs: dict[str, Any] = {
        "messages": common.messages(body.messages),
        "max_tokens": body.max_completion_tokens or body.max_tokens or common.DEFAULT_MAX_TOKENS,
        "stop_words": body.stop_words(),
    }
    if plan.tools:
        common.require(adapter, "tools", "tools")
        inputs["tools"] = plan.tools
    guided = _guided(body.response_format)
    if plan.forced:
        common.require(adapter, "guided_decoding", "tool_choice", "a forced tool call (tool_choice required or named)")
        if guided is not None:
            raise unsupported("response_format", "response_format cannot be combined with a forced tool call")
        schema = toolcalls.forced_call_schema(plan.tools or [])
        guided = {"guide_type": "json_schema", "guide": json.dumps(schema)}
    elif guided is not None:
        common.require(adapter, "guided_decoding", "response_format", f"response_format {body.response_format.type}")  # type: ignore[union-attr]
    if guided is not None:
        inputs["guided_decoding"] = guided
    count = body.choices
    if count > MAX_CHOICES:
        raise unsupported("n", f"n may be at most {MAX_CHOICES}")
    native = parameters(
        body,
        adapter,
        logprobs=plan.logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_cache_key=body.prompt_cache_key,
    )
    labels = common.metadata(body, "chat.completions", plan.tier)
    return _choices(body, svc, inputs, native, labels, plan.tier, seeds(body.seed, count, seed_key))


def _choices(
    body: ChatCompletionRequest | CompletionRequest,
    svc: Services,
    inputs: dict[str, Any],
    native: dict[str, Any],
    labels: dict[str, str],
    run_as: common.Tier,
    choice_seeds: list[int | None],
) -> list[InferRequest]:
    """One ordinary request per choice, each with its own seed."""
    return [
        InferRequest(
            model=body.model,
            inputs=inputs,
            parameters=native | ({"seed": seed} if seed is not None else {}),
            stream=bool(body.stream),
            metadata=labels,
            priority=run_as.priority,
            timeout_s=common.timeout_for(svc, run_as),
        )
        for seed in choice_seeds
    ]


def completion_request(body: CompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a completion: n for each prompt."""
    adapter = common.llm(svc, body.model, chat=False)
    refuse_unsupported(body, "completions")
    body.check_stream_options()
    run_as = common.tier(body.service_tier)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ApiError(400, "invalid_request", "prompt must not be empty", details={"param": "prompt"})
    if len(prompts) * body.choices > MAX_CHOICES:
        raise unsupported("n", f"n times the prompts may be at most {MAX_CHOICES}")
    native = parameters(
        body,
        adapter,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )
    labels = common.metadata(body, "completions", run_as)
    natives = []
    for number, prompt in enumerate(prompts):
        inputs = {"text_input": prompt, "max_tokens": body.max_tokens or 16, "stop_words": body.stop_words()}
        choice_seeds = seeds(body.seed, body.choices, seed_key and f"{seed_key}:{number}")
        natives += _choices(body, svc, inputs, native, labels, run_as, choice_seeds)
    return natives


# -- answers --------------------------------------------------------------------------------


def _tool_call(request_id: str, index: int, call: toolcalls.ToolCall) -> dict[str, Any]:
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


def chat_completion(
    records: list[ResultRecord],
    body: ChatCompletionRequest,
    tpb: int = 32,
    tool_format: toolcalls.ToolFormat | None = None,
) -> dict[str, Any]:
    plan = chat_plan(body, tool_format)
    choices = []
    for index, record in enumerate(records):
        text = (record.outputs or {}).get("text_output", "")
        content, calls = read_calls(text, plan)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        finish = common.finish_reason(record)
        if calls:
            message["tool_calls"] = [_tool_call(record.request_id, i, call) for i, call in enumerate(calls)]
            finish = "tool_calls" if finish != "length" else finish  # a call cut by max_tokens says so
        logprobs = {"content": common.logprobs_of(record), "refusal": None} if plan.logprobs else None
        choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs})
    first = records[0]
    return {
        "id": f"chatcmpl-{first.request_id}",
        "object": "chat.completion",
        "created": common.created(first),
        "model": body.model,
        "system_fingerprint": None,
        "service_tier": plan.tier.name,
        "choices": choices,
        "usage": common.usage(records, tpb),
    }


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' logprobs object from OpenAI's chat-style entries."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(entry["token"])
        offset += len(entry["token"])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
        "text_offset": offsets,
    }


def text_completion(records: list[ResultRecord], body: CompletionRequest, tpb: int = 32) -> dict[str, Any]:
    choices = []
    for index, record in enumerate(records):
        text = (record.outputs or {}).get("text_output", "")
        logprobs = completion_logprobs(common.logprobs_of(record)) if body.logprobs is not None else None
        choices.append(
            {"index": index, "text": text, "finish_reason": common.finish_reason(record), "logprobs": logprobs}
        )
    first = records[0]
    return {
        "id": f"cmpl-{first.request_id}",
        "object": "text_completion",
        "created": common.created(first),
        "model": body.model,
        "system_fingerprint": None,
        "service_tier": common.tier(body.service_tier).name,
        "choices": choices,
        "usage": common.usage(records, tpb),
    }


@router.post("/chat/completions", summary="Create a chat completion (OpenAI)")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]
) -> Any:
    natives = chat_request(body, services(request), common.idempotency_key(request))
    return await _answer(request, who, body, natives)


@router.post("/completions", summary="Create a completion (OpenAI, legacy)")
async def create_completion(body: CompletionRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    natives = completion_request(body, services(request), common.idempotency_key(request))
    return await _answer(request, who, body, natives)


async def _answer(
    request: Request, who: Caller, body: ChatCompletionRequest | CompletionRequest, natives: list[InferRequest]
) -> Any:
    """Queue the requests; stream their chunks, or wait for them and answer in one piece."""
    svc = services(request)
    run_as = common.tier(body.service_tier)
    if body.stream:  # a stream past the tenant's share of followers: refused before anything is queued
        svc.events.admissible(who.tenant)
    request_ids = await common.start(svc, who, request, natives, flex=run_as.flex)
    headers = {"x-request-id": ",".join(request_ids)}
    tpb = common.tokens_per_block(svc, body.model)
    if body.stream:
        stream = ChunkStream(request_ids, body, tpb, common.tool_format(svc, body.model))
        return EventStream(stream.events(svc), ping=svc.settings.sse_ping_s, headers=headers)
    timeout = natives[0].timeout_s or svc.settings.default_timeout_s
    records = await common.wait_records(svc, who, request_ids, timeout)
    for record in records:
        common.raise_for_record(record)
    if isinstance(body, ChatCompletionRequest):
        return JSONResponse(chat_completion(records, body, tpb, common.tool_format(svc, body.model)), headers=headers)
    return JSONResponse(text_completion(records, body, tpb), headers=headers)


class Pads:
    """Random padding for one stream's deltas (common.obfuscation's), cut from a pool drawn 4 KB
    at a time: drawing for each delta cost more than the rest of its frame."""

    def __init__(self) -> None:
        self.pool, self.at = "", 0

    def take(self, length: int) -> str:
        """Padding that brings a text of `length` characters to a multiple of 16."""
        size = 16 - length % 16
        if self.at + size > len(self.pool):
            self.pool, self.at = secrets.token_urlsafe(3072), 0
        self.at += size
        return self.pool[self.at - size : self.at]


class ChunkStream:
    """The chunks of a streamed chat completion or completion, from the events of its
    requests (one per choice)."""

    def __init__(
        self,
        request_ids: list[str],
        body: ChatCompletionRequest | CompletionRequest,
        tpb: int,
        tool_format: toolcalls.ToolFormat | None = None,
    ) -> None:
        self.request_ids = request_ids
        self.body = body
        self.tpb = tpb
        self.chat = isinstance(body, ChatCompletionRequest)
        self.plan = chat_plan(body, tool_format) if isinstance(body, ChatCompletionRequest) else ChatPlan()
        options = body.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.obfuscate = options is None or options.include_obfuscation
        self.parsers = [
            toolcalls.StreamParser(self.plan.tool_format, tools=self.plan.tools)
            if self.plan.tools and not self.plan.forced
            else None
            for _ in request_ids
        ]
        self.held = [""] * len(request_ids)  # a forced call's text, parsed at the end
        self.calls = [0] * len(request_ids)  # tool calls sent per choice
        self.offsets = [0] * len(request_ids)  # text sent per choice (completions' text_offset)
        self.base = {
            "id": f"{'chatcmpl' if self.chat else 'cmpl'}-{request_ids[0]}",
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": common.created(),
            "model": body.model,
            "system_fingerprint": None,
            "service_tier": common.tier(body.service_tier).name,
        }
        self.templates: dict[int, FrameTemplate] = {}  # a choice's text delta (_text_frame)
        self.pads = Pads()

    def _text_frame(self, index: int, text: str) -> bytes:
        """A chat delta of text, from the choice's template: the same frame _event makes."""
        template = self.templates.get(index)
        if template is None:
            delta = {"content": FrameTemplate.hole(0)}
            choice = {"index": index, "delta": delta, "finish_reason": None, "logprobs": None}
            payload: dict[str, Any] = {**self.base, "choices": [choice]}
            if self.include_usage:
                payload["usage"] = None
            if self.obfuscate:
                payload["obfuscation"] = FrameTemplate.hole(1)
            template = self.templates[index] = FrameTemplate(payload)
        if self.obfuscate:
            return template.fill(json_value(text), f'"{self.pads.take(len(text))}"')
        return template.fill(json_value(text))

    def _event(self, choice: dict[str, Any], text: str = "") -> ServerSentEvent:
        payload: dict[str, Any] = {**self.base, "choices": [choice]}
        if self.include_usage:
            payload["usage"] = None
        if self.obfuscate:
            payload["obfuscation"] = common.obfuscation(text)
        return ServerSentEvent(data=json.dumps(payload, ensure_ascii=False))

    def _delta(self, index: int, delta: dict[str, Any]) -> ServerSentEvent:
        if self.chat:
            return self._event({"index": index, "delta": delta, "finish_reason": None, "logprobs": None})
        text = str(delta.get("content", ""))
        return self._event({"index": index, "text": text, "finish_reason": None, "logprobs": None}, text)

    def _pieces(
        self, index: int, request_id: str, items: list[str | toolcalls.ToolCall]
    ) -> list[ServerSentEvent | bytes]:
        events: list[ServerSentEvent | bytes] = []
        for item in items:
            if isinstance(item, str):
                if item:
                    events.append(self._text(index, item))
            elif self.plan.parallel or self.calls[index] == 0:
                call = _tool_call(request_id, self.calls[index], item)
                events.append(self._delta(index, {"tool_calls": [{"index": self.calls[index], **call}]}))
                self.calls[index] += 1
        return events

    def _text(self, index: int, text: str) -> ServerSentEvent | bytes:
        self.offsets[index] += len(text)
        if self.chat:
            return self._text_frame(index, text)
        return self._delta(index, {"content": text})

    def on_token(self, index: int, request_id: str, text: str) -> list[ServerSentEvent | bytes]:
        if not text:
            return []
        if self.plan.forced:
            self.held[index] += text
            return []
        parser = self.parsers[index]
        if parser is not None:
            return self._pieces(index, request_id, parser.feed(text))
        return [self._text(index, text)]

    def on_end(self, index: int, record: ResultRecord) -> list[ServerSentEvent | bytes]:
        events: list[ServerSentEvent | bytes] = []
        parser = self.parsers[index]
        if parser is not None:
            events += self._pieces(index, record.request_id, parser.finish())
        if self.plan.forced:
            content, calls = read_calls(self.held[index], self.plan)
            items: list[str | toolcalls.ToolCall] = [*calls] if calls else [content or ""]
            events += self._pieces(index, record.request_id, items)
        reason = common.finish_reason(record)  # a call cut by max_tokens says "length"
        finish = "tool_calls" if self.calls[index] and reason != "length" else reason
        entries = common.logprobs_of(record)
        if self.chat:
            logprobs = {"content": entries, "refusal": None} if self.plan.logprobs else None
            choice = {"index": index, "delta": {}, "finish_reason": finish, "logprobs": logprobs}
        else:
            body = self.body
            wanted = isinstance(body, CompletionRequest) and body.logprobs is not None
            logprobs = completion_logprobs(entries) if wanted else None
            choice = {"index": index, "text": "", "finish_reason": finish, "logprobs": logprobs}
        events.append(self._event(choice))
        return events

    async def events(self, svc: Services) -> AsyncIterator[ServerSentEvent | bytes]:
        if self.chat:
            for index in range(len(self.request_ids)):
                yield self._delta(index, {"role": "assistant", "content": ""})
        records: list[ResultRecord] = []
        async for index, event in common.follow_all(svc, self.request_ids):
            if event.kind == "token":
                for chunk in self.on_token(index, self.request_ids[index], common.token_text(event)):
                    yield chunk
            elif event.terminal:
                record = common.record_of(event)
                if record.status != State.SUCCEEDED:
                    code = record.error.code if record.error else record.status.value
                    message = record.error.message if record.error else f"the request was {record.status.value}"
                    error = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
                    yield ServerSentEvent(data=json.dumps(error))
                    break  # (the other choices' requests are cancelled as the stream ends)
                records.append(record)
                for chunk in self.on_end(index, record):
                    yield chunk
        else:
            if self.include_usage:
                usage = common.usage(records, self.tpb)
                yield ServerSentEvent(data=json.dumps({**self.base, "choices": [], "usage": usage}))
        yield ServerSentEvent(data="[DONE]")
