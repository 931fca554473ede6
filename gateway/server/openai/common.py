"""What the /v1 routes share: turning a call into ordinary durable requests, waiting for
their records, following their events, and mapping outcomes to OpenAI's shapes (usage with
cached tokens, service tiers, logprobs, tool calls)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from gateway.protocol import ResultRecord, State, WebhookSpec
from gateway.protocol.http import InferRequest
from gateway.server import spine
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller
from gateway.server.llm.tools import ToolFormat
from gateway.server.models import InvalidInput, ModelAdapter
from gateway.server.models.llm_engine import EngineLlmAdapter
from gateway.server.openai.schemas import TEXT_PARTS, Message, unsupported
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services
from gateway.server.submission import Submission

# A /v1 call may name a webhook for its terminal event (the native API takes it in the body).
WEBHOOK_HEADER = "X-Webhook-Url"
# Default completion budget where the caller gives none (the engine caps it at its context).
DEFAULT_MAX_TOKENS = 512
# service_tier priority runs in the high band (the native priority of this value).
PRIORITY_TIER = 5


def llm(svc: Services, model: str, *, chat: bool) -> ModelAdapter:
    try:
        adapter = svc.registry.get(model)
    except InvalidInput as exc:
        raise ApiError(404, "model_not_found", exc.message, details={"param": "model"}) from None
    if adapter.kind != "llm":
        raise ApiError(400, "invalid_model", f"{model} is not a text generation model", details={"param": "model"})
    if chat and not isinstance(adapter, EngineLlmAdapter):
        raise ApiError(
            400,
            "invalid_model",
            f"{model} takes text only (an ensemble); chat needs a model on its engine",
            details={"param": "model"},
        )
    return adapter


# An ensemble (tensorrtllm_backend's text ensemble) passes the sampling inputs it has on.
ENSEMBLE_FEATURES = frozenset({"repetition_penalty"})


def features(adapter: ModelAdapter) -> frozenset[str]:
    """What the model's contract can do beyond text (llm_engine.py, llm_llmapi.py)."""
    found = getattr(adapter, "features", None)
    return found if isinstance(found, frozenset) else ENSEMBLE_FEATURES


def require(adapter: ModelAdapter, feature: str, param: str, what: str | None = None) -> None:
    """Refuse `param` by name unless the model's contract has the feature."""
    if feature not in features(adapter):
        mode = getattr(getattr(adapter, "spec", None), "mode", "ensemble")
        raise unsupported(param, f"{what or param} is not supported by {adapter.name} (its {mode} contract)")


def tool_format(svc: Services, model: str) -> ToolFormat | None:
    """How the model writes tool calls (its chat template's family), where it is known."""
    tokenizer = getattr(svc.registry.adapters.get(model), "tokenizer", None)
    found = getattr(tokenizer, "tool_format", None)
    return found if isinstance(found, ToolFormat) else None


def context_length(svc: Services, model: str) -> int | None:
    """The model's context in tokens (prompt and answer together), where it is known."""
    found = getattr(svc.registry.adapters.get(model), "context_length", None)
    return found if isinstance(found, int) else None


def tokens_per_block(svc: Services, model: str) -> int:
    spec = svc.registry.specs.get(model)
    return spec.tokens_per_block if spec is not None else 32


def webhook(request: Request) -> WebhookSpec | None:
    url = request.headers.get(WEBHOOK_HEADER)
    if not url:
        return None
    try:
        return WebhookSpec(url=url)
    except ValueError as exc:
        raise ApiError(400, "invalid_webhook", f"{WEBHOOK_HEADER}: {exc}") from None


@dataclass(frozen=True)
class Tier:
    """A service_tier as run: the native priority, whether it is flex (the batch band), and
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


def timeout_for(svc: Services, run_as: Tier) -> float | None:
    """Flex requests wait as long as any request may (a long deadline); others the default."""
    return svc.settings.max_timeout_s if run_as.flex else None


def metadata(body: Any, kind: str, run_as: Tier | None = None) -> dict[str, str]:
    found = {**(getattr(body, "metadata", None) or {}), "api": kind}
    if getattr(body, "user", None):
        found["user"] = body.user[:512]
    if getattr(body, "safety_identifier", None):
        found["safety_identifier"] = body.safety_identifier[:512]
    if run_as is not None and run_as.name != "default":
        found["service_tier"] = run_as.name
    return found


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
                    raise _invalid(f"messages[{index}].content[{part_index}].text", "a text part needs its text")
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            needs = "content or tool_calls" if m.role == "assistant" else "content"
            raise _invalid(f"messages[{index}].content", f"a {m.role} message needs {needs}")
        if m.role == "tool" and not m.tool_call_id:
            raise _invalid(f"messages[{index}].tool_call_id", "a tool message needs the tool_call_id it answers")
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


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_request", f"{param}: {message}", details={"param": param})


IDEMPOTENCY_HEADER = "Idempotency-Key"


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= 255 or not key.isprintable():
        raise ApiError(400, "invalid_idempotency_key", f"{IDEMPOTENCY_HEADER} must be 1 to 255 printable characters")
    return key


async def start(
    svc: Services, who: Caller, request: Request, bodies: list[InferRequest], *, flex: bool = False
) -> list[str]:
    """Queue the ordinary requests behind one call (all or none); their ids. With an
    Idempotency-Key the same call again answers with the first call's requests."""
    return (await submit(svc, who, request, bodies, flex=flex)).request_ids


async def submit(
    svc: Services, who: Caller, request: Request, bodies: list[InferRequest], *, flex: bool = False
) -> Submission:
    """start(), with what the accept stage knows of the requests (their prompt tokens)."""
    hook = webhook(request)
    if hook is not None:
        bodies = [b if b.webhook is not None else b.model_copy(update={"webhook": hook}) for b in bodies]
    key = idempotency_key(request)
    keys = [key] if key is not None and len(bodies) == 1 else None
    if key is not None and len(bodies) > 1:
        keys = [f"{key}:{n}" for n in range(len(bodies))]
    return await svc.submitter.submit_many(who, bodies, idempotency_keys=keys, flex=flex)


async def wait_record(svc: Services, who: Caller, request_id: str, timeout_s: float) -> ResultRecord:
    deadline = time.monotonic() + timeout_s + 5
    while True:
        outcome = await svc.results.wait(request_id, min(svc.settings.max_wait_s, 60.0), who.scope)
        if isinstance(outcome, ResultRecord) and outcome.status.terminal:
            return outcome
        if time.monotonic() > deadline:
            raise after_acceptance(504, "timeout", f"{request_id} did not end in time")


async def wait_records(svc: Services, who: Caller, request_ids: list[str], timeout_s: float) -> list[ResultRecord]:
    records = await asyncio.gather(*(wait_record(svc, who, rid, timeout_s) for rid in request_ids))
    return list(records)


# The request behind the call was accepted and ended: calling again would make another
# one. openai-python retries 409, 5xx and timeouts by default unless told not to.
NO_RETRY = {"x-should-retry": "false"}


def after_acceptance(status: int, code: str, message: str) -> ApiError:
    """An error about a request that was accepted (durable): the client must not retry."""
    return ApiError(status, code, message, headers=NO_RETRY)


def raise_for_record(record: ResultRecord) -> None:
    """A request that did not succeed, as an OpenAI error."""
    if record.status == State.SUCCEEDED:
        return
    error = record.error
    message = error.message if error else record.status.value
    if record.status == State.CANCELED:
        raise after_acceptance(409, "canceled", f"{record.request_id} was canceled")
    if record.status == State.EXPIRED:
        raise after_acceptance(504, "timeout", f"{record.request_id} expired: {message}")
    if error and error.code in ("invalid_input", "prompt_too_long"):
        raise after_acceptance(400, error.code, message)
    raise after_acceptance(502, error.code if error else "inference_failed", message)


async def follow(svc: Services, request_id: str) -> AsyncIterator[StreamEvent]:
    """The request's events from its start; cancels the request if the caller goes away
    before it ends (a non-background stream)."""
    ended = False
    try:
        async for event in svc.events.follow(request_id, "0-0"):
            if event.terminal:
                ended = True
            yield event
    finally:
        if not ended:
            await asyncio.shield(spine.cancel(svc.jobs, request_id))


async def follow_all(svc: Services, request_ids: list[str]) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of several requests as they come, each with its request's index; every
    request still running is cancelled if the caller goes away."""
    if len(request_ids) == 1:
        async for event in follow(svc, request_ids[0]):
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | None]] = asyncio.Queue()

    async def pump(index: int, request_id: str) -> None:
        try:
            async for event in follow(svc, request_id):
                await queue.put((index, event))
        finally:
            await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, rid)) for i, rid in enumerate(request_ids)]
    try:
        running = len(tasks)
        while running:
            index, found = await queue.get()
            if found is None:
                running -= 1
            else:
                yield index, found
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def token_text(event: StreamEvent) -> str:
    return str(json.loads(event.data).get("text_output", ""))


def record_of(event: StreamEvent) -> ResultRecord:
    return ResultRecord.model_validate_json(event.data)


def cached_tokens(record: ResultRecord, tpb: int) -> int:
    """The prompt tokens the engine served from its prefix cache, as it reported them; for
    an engine that reported nothing, the router's estimate: the prompt blocks the chosen
    replica was last sent (Route.matched_blocks)."""
    usage = record.usage
    if usage is None:
        return 0
    if usage.cached_tokens is not None:
        return usage.cached_tokens
    matched = record.route.matched_blocks if record.route else 0
    return min(max(0, usage.prompt_tokens - 1), matched * tpb)


def usage(records: Iterable[ResultRecord], tpb: int = 32) -> dict[str, Any]:
    """OpenAI's usage of the requests behind one call, summed (n choices are n requests:
    each prompt is counted, and the prefix cache's reuse shows in cached_tokens)."""
    prompt = completion = cached = 0
    for record in records:
        prompt += record.usage.prompt_tokens if record.usage else 0
        completion += record.usage.completion_tokens if record.usage else 0
        cached += cached_tokens(record, tpb)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def finish_reason(record: ResultRecord) -> str:
    return str((record.outputs or {}).get("finish_reason", "stop"))


def created(record_or_now: ResultRecord | None = None) -> int:
    return int(record_or_now.created_at.timestamp()) if record_or_now else int(time.time())


def call_id(request_id: str, index: int) -> str:
    """A tool call's id: stable for the request, so a stream and a later read agree."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


def logprobs_of(record: ResultRecord) -> list[dict[str, Any]]:
    """OpenAI's logprobs content entries of the request (the engine adapter made them)."""
    found = (record.outputs or {}).get("logprobs")
    return list(found) if isinstance(found, list) else []


def obfuscation(text: str) -> str:
    """Random padding for a streamed delta (OpenAI's include_obfuscation): the delta and its
    padding together come to a multiple of 16 characters, at least 16, so the size of an
    event does not tell how long its text is."""
    size = 16 - len(text) % 16
    return secrets.token_urlsafe(size)[:size]
