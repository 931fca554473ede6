"""HTTP routes: submit, results (poll, long-poll, SSE), cancel, search, health, metrics."""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from redis.asyncio import Redis
from sse_starlette import EventSourceResponse, ServerSentEvent

from gateway.adapters import ADAPTERS
from gateway.contracts import (
    TERMINAL_EVENT,
    ResultRecord,
    State,
    events_key,
    lane_for,
    new_request_id,
)
from gateway.binder_client import BinderClient
from gateway.dispatcher import Dispatcher
from gateway.errors import ApiError, _plain
from gateway.jobs import JobStore
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool
from gateway.results import ResultReader, is_final, result_urls
from gateway.schemas import Accepted, CancelResponse, InferRequest, LiveStatus, SearchRequest, SearchResponse
from gateway.search import SearchService
from gateway.settings import GatewaySettings

router = APIRouter()

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d+(?:\.\d+)?)", re.IGNORECASE)
_EVENT_ID = re.compile(r"^\d+-\d+$")
_TERMINAL_EVENTS = {kind.value for kind in TERMINAL_EVENT.values()}


@dataclass
class Services:
    settings: GatewaySettings
    redis: Redis
    jobs: JobStore
    pool: ReplicaPool
    dispatcher: Dispatcher
    results: ResultReader
    search: SearchService
    binders: BinderClient
    metrics: GatewayMetrics


def services(request: Request) -> Services:
    return request.app.state.services


def _outcome_response(outcome: ResultRecord | LiveStatus, status: int = 200, headers: dict[str, str] | None = None):
    return Response(outcome.model_dump_json(), status_code=status, headers=headers, media_type="application/json")


def _body_hash(body: InferRequest) -> str:
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
        422: {"description": "Invalid request (unknown_model, invalid_inputs, validation_error, idempotency_key_reused)"},
        429: {"description": "Backlog full; retry after `Retry-After` seconds"},
    },
)
async def infer(
    body: InferRequest,
    request: Request,
    idempotency_key: Annotated[str | None, Header(alias="Idempotency-Key", max_length=255)] = None,
    prefer: Annotated[str | None, Header(description="wait=N: hold the response up to N s for the result")] = None,
    accept: Annotated[str | None, Header(description="text/event-stream: answer with the request's events")] = None,
) -> Any:
    """Accept a request at once (it is in Redis before the 202 goes out) and return its id.

    With `Accept: text/event-stream` the answer is the request's event stream (as from
    /results/{id}/events), saving a round trip before the first token; the request is
    queued durably first, and `Location` names it for resuming."""
    svc = services(request)
    settings = svc.settings
    adapter = ADAPTERS.get(body.model)
    if adapter is None:
        raise ApiError(422, "unknown_model", f"unknown model {body.model!r}; served: {', '.join(sorted(ADAPTERS))}")
    try:
        inputs, _ = adapter.validate(body.inputs, body.parameters)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ApiError(
            422, "invalid_inputs", f"{body.model}: {where}: {first['msg']}", details=_plain(exc.errors())
        ) from None
    timeout_s = body.timeout_s or settings.default_timeout_s
    if timeout_s > settings.max_timeout_s:
        raise ApiError(422, "timeout_too_long", f"timeout_s may be at most {settings.max_timeout_s:g}")

    now = time.time()
    request_id = new_request_id(now)
    payload = {
        "inputs": body.inputs,
        "parameters": body.parameters,
        "stream": body.stream,
        "webhook": body.webhook.model_dump() if body.webhook else None,
        "inputs_stored": adapter.describe_inputs(inputs),
        "priority": body.priority,
    }
    body_hash = _body_hash(body) if idempotency_key else None
    wait = _prefer_wait(prefer, settings.max_wait_s)
    # Watch before submitting, so an ending that comes at once is not missed.
    async with svc.results.notifier.watch(request_id) as ended:
        submitted = await svc.jobs.submit(
            request_id=request_id, model=body.model, payload=payload, created_at=now,
            deadline=now + timeout_s, lane=lane_for(body.priority), max_backlog=settings.max_backlog,
            idempotency=(idempotency_key, body_hash) if idempotency_key and body_hash else None,
        )
        if submitted.outcome == "full":
            raise ApiError(
                429, "backlog_full", f"{submitted.backlog} requests are waiting; try again shortly",
                headers={"Retry-After": str(settings.retry_after_s)},
            )
        if submitted.outcome == "existing":
            if submitted.body_hash != body_hash:
                raise ApiError(422, "idempotency_key_reused", "this Idempotency-Key was used with a different request body")
            return await _answer(svc, submitted.request_id or "", wait)
        svc.metrics.accepted.labels(body.model).inc()
        if accept and "text/event-stream" in accept:
            return EventSourceResponse(
                _stream_events(svc.redis, request_id, "0-0"), ping=settings.sse_ping_s,
                headers={**_SSE_HEADERS, **_location(request_id)},
            )
        if not wait:
            return _accepted(request_id, State.QUEUED)
        record = await svc.results.ended(ended, wait)
        if record is not None:
            return _outcome_response(record, 200, {**_location(request_id), "Preference-Applied": f"wait={wait:g}"})
    return await _answer(svc, request_id, 0)


def _location(request_id: str) -> dict[str, str]:
    return {"Location": f"/results/{request_id}"}


async def _answer(svc: Services, request_id: str, wait: float | None) -> JSONResponse:
    """200 with the result if it has ended (within wait), else 202 with the state."""
    outcome = await svc.results.wait(request_id, wait or 0)
    if is_final(outcome):
        headers = {**_location(request_id), **({"Preference-Applied": f"wait={wait:g}"} if wait else {})}
        return _outcome_response(outcome, 200, headers)
    return _accepted(request_id, outcome.status)


def _accepted(request_id: str, status: State) -> JSONResponse:
    accepted = Accepted(request_id=request_id, status=status, urls=result_urls(request_id))
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202, headers=_location(request_id))


def _prefer_wait(prefer: str | None, limit: float) -> float | None:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), limit) if match else None


@router.get("/results/{request_id}", summary="Get a result (long-poll with ?wait=N)",
            responses={404: {"description": "Unknown id"}, 410: {"description": "Result expired"}})
async def get_result(
    request_id: str,
    request: Request,
    wait: Annotated[float | None, Query(ge=0, description="Hold up to N s; return the moment it ends")] = None,
) -> Any:
    svc = services(request)
    if wait:
        outcome = await svc.results.wait(request_id, min(wait, svc.settings.max_wait_s))
    else:
        outcome = await svc.results.get(request_id)
    return _outcome_response(outcome)


@router.get("/results/{request_id}/events", summary="Server-Sent Events of a request",
            responses={404: {"description": "Unknown id"}, 410: {"description": "Result expired"}})
async def result_events(
    request_id: str,
    request: Request,
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
) -> EventSourceResponse:
    """queued, running, token (llm with stream) or output, then completed / failed /
    canceled / expired. Each event's id resumes the stream through Last-Event-ID."""
    svc = services(request)
    if last_event_id is not None and not _EVENT_ID.match(last_event_id):
        raise ApiError(422, "invalid_last_event_id", "Last-Event-ID must be an event id this stream sent")
    if not await svc.redis.exists(events_key(request_id)):
        # Events are kept for a while after the end; after that, replay the stored record.
        outcome = await svc.results.get(request_id)
        return EventSourceResponse(_replay_record(outcome), ping=svc.settings.sse_ping_s, headers=_SSE_HEADERS)
    return EventSourceResponse(
        _stream_events(svc.redis, request_id, last_event_id or "0-0"), ping=svc.settings.sse_ping_s,
        headers=_SSE_HEADERS,
    )


_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def _stream_events(redis: Redis, request_id: str, after: str) -> AsyncIterator[ServerSentEvent]:
    key = events_key(request_id)
    while True:
        reply = await redis.xread({key: after}, count=256, block=5000)
        if not reply:
            if not await redis.exists(key):
                return  # expired while nothing happened
            continue
        for entry_id, fields in reply[0][1]:
            after = entry_id
            yield ServerSentEvent(data=fields.get("data", "{}"), event=fields.get("event"), id=entry_id)
            if fields.get("event") in _TERMINAL_EVENTS:
                return


async def _replay_record(outcome: ResultRecord | LiveStatus) -> AsyncIterator[ServerSentEvent]:
    if isinstance(outcome, ResultRecord) and outcome.status in TERMINAL_EVENT:
        millis = int(outcome.finished_at.timestamp() * 1000) if outcome.finished_at else 0
        yield ServerSentEvent(
            data=outcome.model_dump_json(), event=TERMINAL_EVENT[outcome.status].value, id=f"{millis}-0"
        )


@router.post("/results/{request_id}/cancel", response_model=CancelResponse, summary="Cancel a request",
             responses={404: {"description": "Unknown id"}, 409: {"description": "Already finished"}})
async def cancel(request_id: str, request: Request) -> Any:
    """Queued work never runs; running work has its Triton stream cancelled."""
    svc = services(request)
    async with svc.results.notifier.watch(request_id) as ended:
        state = await svc.jobs.cancel(request_id)
        if state is None:
            await svc.results.get(request_id)  # raises 404 or 410
            raise ApiError(409, "already_finished", f"{request_id} already finished")
        if state == State.RUNNING:
            try:  # usually ends within a generation step
                await asyncio.wait_for(ended, timeout=5)
            except TimeoutError:
                pass
            job = await svc.jobs.load(request_id)
            state = job.state if job else state
    if state in (State.SUCCEEDED, State.FAILED, State.EXPIRED):
        raise ApiError(409, "already_finished", f"{request_id} already ended: {state.value}")
    message = "canceled" if state == State.CANCELED else "cancel requested; the request is stopping"
    code = 200 if state == State.CANCELED else 202
    return JSONResponse(
        CancelResponse(request_id=request_id, status=state, message=message).model_dump(mode="json"), status_code=code
    )


@router.post("/search", response_model=SearchResponse, summary="Find the stored results nearest a text or image")
async def search(body: SearchRequest, request: Request) -> Any:
    return await services(request).search.search(body)


@router.post("/results/{request_id}/webhook/replay", summary="Send a request's webhook again",
             responses={404: {"description": "No stored result"}, 409: {"description": "The request has no webhook"}})
async def replay_webhook(request_id: str, request: Request) -> Any:
    """Queue the stored result's webhook once more (same webhook-id, so receivers can de-duplicate)."""
    return await services(request).binders.replay_webhook(request_id)


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="Readiness: Redis reachable and at least one Triton replica ready")
async def readyz(request: Request) -> Any:
    svc = services(request)
    try:
        await svc.redis.ping()
    except Exception as exc:
        raise ApiError(503, "redis_unavailable", f"Redis is not reachable: {exc}") from None
    if not svc.pool.ready():
        raise ApiError(503, "no_replica", "no Triton replica is ready")
    ready = [r.url for r in svc.pool.replicas if r.healthy]
    return {"status": "ready", "replicas": ready}


@router.get("/metrics", summary="Prometheus metrics", include_in_schema=True)
async def metrics(request: Request) -> Response:
    return Response(generate_latest(services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)

