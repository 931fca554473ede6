"""What the /v1 routes share: turning a call into an ordinary durable request, waiting
for its record, following its events, and mapping outcomes to OpenAI's shapes."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from gateway.protocol import ResultRecord, State, WebhookSpec
from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller
from gateway.server.models import InvalidInput, ModelAdapter
from gateway.server.models.llm_engine import EngineLlmAdapter
from gateway.server.openai.schemas import Message, Sampling
from gateway.server.results.events import StreamEvent
from gateway.server.services import Services

# A /v1 call may name a webhook for its terminal event (the native API takes it in the body).
WEBHOOK_HEADER = "X-Webhook-Url"
# Default completion budget where the caller gives none (the engine caps it at its context).
DEFAULT_MAX_TOKENS = 512


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


def webhook(request: Request) -> WebhookSpec | None:
    url = request.headers.get(WEBHOOK_HEADER)
    if not url:
        return None
    try:
        return WebhookSpec(url=url)
    except ValueError as exc:
        raise ApiError(400, "invalid_webhook", f"{WEBHOOK_HEADER}: {exc}") from None


def parameters(body: Sampling) -> dict[str, Any]:
    found = {"temperature": body.temperature, "top_p": body.top_p, "seed": body.seed}
    return {k: v for k, v in found.items() if v is not None}


def metadata(body: Sampling, kind: str) -> dict[str, str]:
    found = {**(body.metadata or {}), "api": kind}
    if body.user:
        found["user"] = body.user[:512]
    return found


def refuse_n(body: Sampling) -> None:
    if body.n != 1:
        raise ApiError(
            400, "unsupported_parameter", "n > 1 is not supported: send n separate requests", details={"param": "n"}
        )


def messages(items: list[Message]) -> list[dict[str, str]]:
    return [{"role": m.role, "content": m.text()} for m in items]


IDEMPOTENCY_HEADER = "Idempotency-Key"


def idempotency_key(request: Request) -> str | None:
    key = request.headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not 0 < len(key) <= 255 or not key.isprintable():
        raise ApiError(400, "invalid_idempotency_key", f"{IDEMPOTENCY_HEADER} must be 1 to 255 printable characters")
    return key


async def start(svc: Services, who: Caller, request: Request, bodies: list[InferRequest]) -> list[str]:
    """Queue the ordinary requests behind one call (all or none); their ids. With an
    Idempotency-Key the same call again answers with the first call's requests."""
    hook = webhook(request)
    if hook is not None:
        bodies = [b if b.webhook is not None else b.model_copy(update={"webhook": hook}) for b in bodies]
    key = idempotency_key(request)
    keys = [key] if key is not None and len(bodies) == 1 else None
    if key is not None and len(bodies) > 1:
        keys = [f"{key}:{n}" for n in range(len(bodies))]
    return (await svc.submitter.submit_many(who, bodies, idempotency_keys=keys)).request_ids


async def wait_record(svc: Services, who: Caller, request_id: str, timeout_s: float) -> ResultRecord:
    deadline = time.monotonic() + timeout_s + 5
    while True:
        outcome = await svc.results.wait(request_id, min(svc.settings.max_wait_s, 60.0), who.scope)
        if isinstance(outcome, ResultRecord) and outcome.status.terminal:
            return outcome
        if time.monotonic() > deadline:
            raise after_acceptance(504, "timeout", f"{request_id} did not end in time")


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
            await asyncio.shield(svc.jobs.cancel(request_id))


def token_text(event: StreamEvent) -> str:
    return str(json.loads(event.data).get("text_output", ""))


def record_of(event: StreamEvent) -> ResultRecord:
    return ResultRecord.model_validate_json(event.data)


def usage(record: ResultRecord) -> dict[str, int]:
    prompt = record.usage.prompt_tokens if record.usage else 0
    completion = record.usage.completion_tokens if record.usage else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def finish_reason(record: ResultRecord) -> str:
    return str((record.outputs or {}).get("finish_reason", "stop"))


def created(record_or_now: ResultRecord | None = None) -> int:
    return int(record_or_now.created_at.timestamp()) if record_or_now else int(time.time())
