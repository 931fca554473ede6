"""GET /results/<id>/events: Server-Sent Events of a request.

queued, running, token (llm with stream) or output, then completed / failed / canceled /
expired. Each event's id is its Redis stream id, so Last-Event-ID resumes with nothing
lost or repeated; a resume after the terminal event answers 204 (nothing more will come:
EventSource clients stop reconnecting)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import Response
from sse_starlette import ServerSentEvent

from gateway.common.redis import REDIS_OUTAGE
from gateway.protocol import TERMINAL_EVENT, ResultRecord, State
from gateway.protocol.http import LiveStatus
from gateway.protocol.redis_keys import shard_of
from gateway.server.api.errors import ApiError
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.errors import Refused
from gateway.server.results.events import MAX_ID_PART, TERMINAL_KINDS, event_order
from gateway.server.services import Services, services

router = APIRouter()

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def parse_event_id(value: str) -> str:
    """An event id this stream sends (a Redis stream id, ms-seq, each an unsigned 64-bit
    number; or ms-seq-0 for the event an entry holds before its own), or 422."""
    millis, dash, rest = value.partition("-")
    seq, second_dash, sub = rest.partition("-")
    if (
        not dash
        or not millis.isdigit()
        or not seq.isdigit()
        or len(millis) > 20
        or len(seq) > 20
        or int(millis) > MAX_ID_PART
        or int(seq) > MAX_ID_PART
        or (second_dash and sub != "0")
    ):
        raise ApiError(422, "invalid_last_event_id", "Last-Event-ID must be an event id this stream sent")
    return f"{int(millis)}-{int(seq)}" + ("-0" if second_dash else "")


@router.get(
    "/results/{request_id}/events",
    summary="Server-Sent Events of a request",
    responses={
        204: {"description": "Nothing after Last-Event-ID: the request has ended"},
        404: {"description": "Unknown id"},
        410: {"description": "Result expired"},
        429: {"description": "The tenant holds its share of this process's event streams (tenant_share_exceeded)"},
        503: {"description": "This process holds all the event streams it may (too_many_streams)"},
    },
)
async def result_events(
    request_id: str,
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    last_event_id: Annotated[str | None, Header(alias="Last-Event-ID", max_length=64)] = None,
) -> Any:
    svc = services(request)
    after = parse_event_id(last_event_id) if last_event_id is not None else "0-0"
    job = await svc.results.job(request_id, who.scope)
    if job is None or not await svc.redis.exists(shard_of(request_id).events(request_id)):
        # Events are kept for a while after the end; after that, replay the stored record.
        outcome = await svc.results.get(request_id, who.scope)  # 404 / 410 for unknown ids
        return EventStream(_replay_record(outcome, after), ping=svc.settings.sse_ping_s, headers=SSE_HEADERS)
    last = await svc.redis.xrevrange(shard_of(request_id).events(request_id), count=1)
    if last and last[0][1].get("event") in TERMINAL_KINDS and event_order(after) >= event_order(last[0][0]):
        return Response(status_code=204)
    # Refused before the stream starts (a 429 or 503, not an error event) when it would be.
    svc.events.admissible(who.tenant)
    return EventStream(
        sse_events(svc, request_id, after, who.tenant), ping=svc.settings.sse_ping_s, headers=SSE_HEADERS
    )


# While a followed request waits in its queue, a `queue` event says where it stands this often.
QUEUE_EVERY_S = 1.0


async def sse_events(svc: Services, request_id: str, after: str, tenant: str) -> AsyncIterator[ServerSentEvent]:
    """The request's events; while it is queued, `queue` events (without an id: nothing to
    resume from) with its place and expected start, when that changes. Held against the
    tenant's share of the process's followers: refused (an `error` event) when it holds
    it all."""
    queued = True  # until a later event says otherwise
    last: str | None = None
    try:
        async for event in svc.events.follow_idle(request_id, after, idle_s=QUEUE_EVERY_S, tenant=tenant):
            if event is not None:
                queued = event.kind == "queued"
                yield ServerSentEvent(data=event.data, event=event.kind, id=event.id)
            elif queued:
                try:
                    job = await svc.jobs.status(request_id)  # never the payload: a tick a second
                    standing = (
                        await svc.results.standing(job) if job is not None and job.state == State.QUEUED else None
                    )
                except REDIS_OUTAGE:  # Redis away: no place to tell this turn; the events wait for it
                    continue
                queued = standing is not None
                if standing is not None and standing.model_dump_json() != last:
                    last = standing.model_dump_json()
                    yield ServerSentEvent(data=last, event="queue")
    except Refused as exc:  # (the tenant's share, or the whole pool, taken since it was checked)
        yield ServerSentEvent(data=json.dumps({"code": exc.code, "message": exc.message}), event="error")


async def _replay_record(outcome: ResultRecord | LiveStatus, after: str) -> AsyncIterator[ServerSentEvent]:
    if isinstance(outcome, ResultRecord) and outcome.status in TERMINAL_EVENT:
        millis = int(outcome.finished_at.timestamp() * 1000) if outcome.finished_at else 0
        event_id = f"{millis}-0"
        if event_order(event_id) > event_order(after):
            yield ServerSentEvent(
                data=outcome.model_dump_json(), event=TERMINAL_EVENT[outcome.status].value, id=event_id
            )
