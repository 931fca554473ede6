"""A call's requests run: submitted (all or none, with the call's Idempotency-Key and
webhook), waited for, followed, and their records read: an outcome that is not a success
as the error the door answers, the text of a token event, the usage summed."""

from __future__ import annotations

import asyncio
import json
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
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services
from gateway.server.submission import Submission

# A call may name a webhook for its terminal event (the native API takes it in the body).
WEBHOOK_HEADER = "X-Webhook-Url"
IDEMPOTENCY_HEADER = "Idempotency-Key"


def webhook(request: Request) -> WebhookSpec | None:
    url = request.headers.get(WEBHOOK_HEADER)
    if not url:
        return None
    try:
        return WebhookSpec(url=url)
    except ValueError as exc:
        raise ApiError(400, "invalid_webhook", f"{WEBHOOK_HEADER}: {exc}") from None


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
    """A request that did not succeed, as the error the door answers (in its API's shape)."""
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


async def follow(svc: Services, request_id: str, tenant: str) -> AsyncIterator[StreamEvent]:
    """The request's events from its start, held against the share of `tenant` (the
    caller's); cancels the request if the caller goes away before it ends (a
    non-background stream)."""
    ended = False
    try:
        async for event in svc.events.follow(request_id, "0-0", tenant=tenant):
            if event.terminal:
                ended = True
            yield event
    finally:
        if not ended:
            await asyncio.shield(spine.cancel(svc.jobs, request_id))


async def follow_all(svc: Services, request_ids: list[str], tenant: str) -> AsyncIterator[tuple[int, StreamEvent]]:
    """The events of several requests as they come, each with its request's index; every
    request still running is cancelled if the caller goes away."""
    if len(request_ids) == 1:
        async for event in follow(svc, request_ids[0], tenant):
            yield 0, event
        return
    queue: asyncio.Queue[tuple[int, StreamEvent | None]] = asyncio.Queue()

    async def pump(index: int, request_id: str) -> None:
        try:
            async for event in follow(svc, request_id, tenant):
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


@dataclass(frozen=True)
class Usage:
    """The tokens of the requests behind one call, summed (n choices are n requests: each
    prompt is counted; `cached` the prompt tokens the prefix cache served)."""

    prompt: int = 0
    completion: int = 0
    cached: int = 0


def usage(records: Iterable[ResultRecord], tpb: int = 32) -> Usage:
    prompt = completion = cached = 0
    for record in records:
        prompt += record.usage.prompt_tokens if record.usage else 0
        completion += record.usage.completion_tokens if record.usage else 0
        cached += cached_tokens(record, tpb)
    return Usage(prompt, completion, cached)


def finish_reason(record: ResultRecord) -> str:
    return str((record.outputs or {}).get("finish_reason", "stop"))


def logprobs_of(record: ResultRecord) -> list[dict[str, Any]]:
    """The logprobs content entries of the request (OpenAI's chat shape: the engine adapter
    made them)."""
    found = (record.outputs or {}).get("logprobs")
    return list(found) if isinstance(found, list) else []
