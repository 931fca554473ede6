"""The answer to POST /infer: a request accepted at once (it is in Redis before the answer
goes out). The route itself, its checks and its OpenAPI entry are gateway.server.api.hot."""

from __future__ import annotations

import re
from contextlib import nullcontext

from fastapi.responses import JSONResponse, Response

from gateway.protocol import State
from gateway.protocol.http import Accepted, InferRequest, result_urls
from gateway.server.api.events import SSE_HEADERS, sse_events
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller
from gateway.server.services import Services

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d{1,6}(?:\.\d{1,6})?)", re.IGNORECASE)


def location(request_id: str) -> dict[str, str]:
    return {"Location": f"/results/{request_id}"}


def accepted(request_id: str, status: State) -> JSONResponse:
    body = Accepted(request_id=request_id, status=status, urls=result_urls(request_id))
    return JSONResponse(body.model_dump(mode="json"), status_code=202, headers=location(request_id))


def prefer_wait(prefer: str | None, limit: float) -> float | None:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), limit) if match else None


async def infer_response(
    svc: Services,
    who: Caller,
    body: InferRequest,
    idempotency_key: str | None,
    prefer: str | None,
    accept: str | None,
) -> Response:
    """The answer to POST /infer, its key, body and headers checked (gateway.server.api.hot)."""
    submission = await svc.submitter.submit(who, body, idempotency_key=idempotency_key)
    request_id = submission.request_id
    wait = prefer_wait(prefer, svc.settings.max_wait_s)
    if submission.existing:
        return await answer(svc, who, request_id, wait)
    if wait and not (accept and "text/event-stream" in accept):
        # Started here: nothing to read yet. Watch for its end first (no await since it was
        # started, so the end cannot come before the watch), read only if it does not come.
        # Queued: another process may have taken and ended it meanwhile: read first.
        return await answer(svc, who, request_id, wait, fresh=submission.started_here)
    if accept and "text/event-stream" in accept:
        return EventStream(
            sse_events(svc, request_id, "0-0", who.tenant),
            ping=svc.settings.sse_ping_s,
            headers={**SSE_HEADERS, **location(request_id)},
        )
    if not wait:
        return accepted(request_id, State.QUEUED)
    return await answer(svc, who, request_id, wait)


async def answer(svc: Services, who: Caller, request_id: str, wait: float | None, fresh: bool = False) -> Response:
    """200 with the result if it has ended (within wait), else 202 with the state. fresh:
    the request was accepted by this very call. A tenant that holds its share of the
    process's long polls is answered at once (its request is accepted all the same)."""
    if wait and not svc.events.room_for(who.tenant):
        wait = None
    with svc.events.holding(who.tenant) if wait else nullcontext():
        final, body, status = await svc.results.wait_json(request_id, wait or 0, who.scope, fresh=fresh)
    if final:
        headers = {**location(request_id), **({"Preference-Applied": f"wait={wait:g}"} if wait else {})}
        return Response(body, status_code=200, headers=headers, media_type="application/json")
    return accepted(request_id, status)
