"""POST /infer: accept a request at once (it is in Redis before the answer goes out)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from gateway.common.logs import bind_request_ids
from gateway.protocol import ResultRecord, State, new_request_id
from gateway.protocol.http import Accepted, InferRequest, LiveStatus, result_urls
from gateway.protocol.redis_keys import band_for, queue_stream
from gateway.server.api.errors import ApiError
from gateway.server.api.events import SSE_HEADERS, sse_events
from gateway.server.api.request_id import current_trace_id
from gateway.server.api.tenancy import Caller, caller
from gateway.server.models import InvalidInput
from gateway.server.results.reader import is_final
from gateway.server.services import Services, services

router = APIRouter()

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d{1,6}(?:\.\d{1,6})?)", re.IGNORECASE)


def outcome_response(
    outcome: ResultRecord | LiveStatus, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(outcome.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def location(request_id: str) -> dict[str, str]:
    return {"Location": f"/results/{request_id}"}


def accepted(request_id: str, status: State) -> JSONResponse:
    body = Accepted(request_id=request_id, status=status, urls=result_urls(request_id))
    return JSONResponse(body.model_dump(mode="json"), status_code=202, headers=location(request_id))


def prefer_wait(prefer: str | None, limit: float) -> float | None:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), limit) if match else None


def body_hash(body: InferRequest) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@router.post(
    "/infer",
    status_code=202,
    response_model=Accepted,
    summary="Submit a request",
    responses={
        200: {"description": "With `Prefer: wait=N`: the result, if it was ready within N seconds"},
        413: {"description": "Body too large"},
        422: {
            "description": "Invalid request (unknown_model, invalid_inputs, validation_error, "
            "idempotency_key_reused, prompt_too_long)"
        },
        429: {"description": "Backlog full; retry after `Retry-After` seconds"},
        503: {"description": "Redis unavailable (redis_unavailable)"},
    },
)
async def infer(
    body: InferRequest,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
    prefer: Annotated[str | None, Header(description="wait=N: hold the response up to N s for the result")] = None,
    accept: Annotated[str | None, Header(description="text/event-stream: answer with the request's events")] = None,
) -> Any:
    """Accept a request at once and return its id.

    With `Accept: text/event-stream` the answer is the request's event stream (as from
    /results/{id}/events), saving a round trip before the first token; the request is
    queued durably first, and `Location` names it for resuming."""
    svc = services(request)
    submission = await submit(svc, who, body, idempotency_key=idempotency_key)
    request_id = submission.request_id
    wait = prefer_wait(prefer, svc.settings.max_wait_s)
    if submission.existing:
        return await answer(svc, who, request_id, wait)
    if accept and "text/event-stream" in accept:
        return EventSourceResponse(
            sse_events(svc, request_id, "0-0"),
            ping=svc.settings.sse_ping_s,
            headers={**SSE_HEADERS, **location(request_id)},
        )
    if not wait:
        return accepted(request_id, State.QUEUED)
    return await answer(svc, who, request_id, wait)


class Submission:
    def __init__(self, request_id: str, existing: bool) -> None:
        self.request_id, self.existing = request_id, existing


async def submit(
    svc: Services,
    who: Caller,
    body: InferRequest,
    *,
    idempotency_key: str | None = None,
    batch: bool = False,
    extra_payload: dict[str, Any] | None = None,
) -> Submission:
    """Validate and queue a request; the id of the new (or, by idempotency key, the
    earlier) request. Shared by the native API and the OpenAI-compatible one."""
    settings = svc.settings
    try:
        adapter = svc.registry.get(body.model)
        prepared = adapter.validate(body.inputs, body.parameters)
    except InvalidInput as exc:
        raise ApiError(422, exc.code, exc.message, details=exc.details) from None
    timeout_s = body.timeout_s or settings.default_timeout_s
    if timeout_s > settings.max_timeout_s:
        raise ApiError(422, "timeout_too_long", f"timeout_s may be at most {settings.max_timeout_s:g}")
    # Rate limits (the prompt's tokens count against tokens per minute up front).
    estimate = len(getattr(prepared, "prompt_ids", ())) or 1
    who.headers |= await svc.quotas.admit(who.config, estimate)
    now = time.time()
    request_id = new_request_id(now)
    payload = {
        "inputs": body.inputs,
        "parameters": body.parameters,
        "stream": body.stream,
        "webhook": body.webhook.model_dump() if body.webhook else None,
        "inputs_stored": adapter.stored_inputs(prepared),
        "priority": body.priority,
        "metadata": body.metadata,
        # The submitting call's X-Request-ID: the dispatcher and the binder log under it.
        "trace_id": current_trace_id(),
        **(extra_payload or {}),
    }
    band = band_for(body.priority, batch=batch)
    stream = queue_stream(body.model, band, who.tenant)
    idempotency = (idempotency_key, body_hash(body)) if idempotency_key else None
    submitted = await svc.jobs.submit(
        request_id=request_id,
        model=body.model,
        tenant=who.tenant,
        payload=payload,
        created_at=now,
        deadline=now + timeout_s,
        stream=stream,
        band=band,
        max_backlog=settings.max_backlog,
        max_backlog_bytes=settings.max_backlog_bytes,
        tenant_max_queued=who.max_queued,
        idempotency=idempotency,
        start_as=svc.dispatcher.can_start_now(body.model, who.tenant),
    )
    if submitted.outcome == "full":
        what = {
            "backlog": "requests are waiting",
            "bytes": "bytes of requests are waiting",
            "tenant": "of your requests are waiting",
        }[submitted.reason]
        raise ApiError(
            429,
            "backlog_full",
            f"{submitted.count} {what}; try again shortly",
            headers={"Retry-After": str(settings.retry_after_s)},
        )
    if submitted.outcome == "existing":
        if idempotency is None or submitted.body_hash != idempotency[1]:
            raise ApiError(422, "idempotency_key_reused", "this Idempotency-Key was used with a different request body")
        bind_request_ids(trace_id=current_trace_id(), request_id=submitted.request_id)
        return Submission(submitted.request_id or "", existing=True)
    bind_request_ids(trace_id=current_trace_id(), request_id=request_id)  # for the call's access line
    svc.metrics.accepted.labels(body.model).inc()
    if submitted.outcome == "started":
        svc.dispatcher.adopt(
            request_id=request_id,
            stream=stream,
            entry=submitted.entry,
            model=body.model,
            tenant=who.tenant,
            payload=payload,
            created_at=now,
            deadline=now + timeout_s,
        )
    else:
        svc.dispatcher.notice(stream)
    return Submission(request_id, existing=False)


async def answer(svc: Services, who: Caller, request_id: str, wait: float | None) -> Response:
    """200 with the result if it has ended (within wait), else 202 with the state."""
    outcome = await svc.results.wait(request_id, wait or 0, who.scope)
    if is_final(outcome):
        headers = {**location(request_id), **({"Preference-Applied": f"wait={wait:g}"} if wait else {})}
        return outcome_response(outcome, 200, headers)
    return accepted(request_id, outcome.status)
