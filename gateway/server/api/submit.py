"""POST /infer: accept a request at once (it is in Redis before the answer goes out)."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, Response

from gateway.protocol import State
from gateway.protocol.http import Accepted, InferRequest, result_urls
from gateway.server.api.events import SSE_HEADERS, sse_events
from gateway.server.api.sse import EventStream
from gateway.server.api.tenancy import Caller, caller
from gateway.server.services import Services, services

router = APIRouter()

_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*(\d{1,6}(?:\.\d{1,6})?)", re.IGNORECASE)


def location(request_id: str) -> dict[str, str]:
    return {"Location": f"/results/{request_id}"}


def accepted(request_id: str, status: State) -> JSONResponse:
    body = Accepted(request_id=request_id, status=status, urls=result_urls(request_id))
    return JSONResponse(body.model_dump(mode="json"), status_code=202, headers=location(request_id))


def prefer_wait(prefer: str | None, limit: float) -> float | None:
    match = _PREFER_WAIT.search(prefer or "")
    return min(float(match.group(1)), limit) if match else None


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
    return await infer_response(services(request), who, body, idempotency_key, prefer, accept)


async def infer_response(
    svc: Services,
    who: Caller,
    body: InferRequest,
    idempotency_key: str | None,
    prefer: str | None,
    accept: str | None,
) -> Response:
    """The answer to POST /infer (FastAPI's route and the hot route both call it)."""
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
            sse_events(svc, request_id, "0-0"),
            ping=svc.settings.sse_ping_s,
            headers={**SSE_HEADERS, **location(request_id)},
        )
    if not wait:
        return accepted(request_id, State.QUEUED)
    return await answer(svc, who, request_id, wait)


async def answer(svc: Services, who: Caller, request_id: str, wait: float | None, fresh: bool = False) -> Response:
    """200 with the result if it has ended (within wait), else 202 with the state. fresh:
    the request was accepted by this very call."""
    final, body, status = await svc.results.wait_json(request_id, wait or 0, who.scope, fresh=fresh)
    if final:
        headers = {**location(request_id), **({"Preference-Applied": f"wait={wait:g}"} if wait else {})}
        return Response(body, status_code=200, headers=headers, media_type="application/json")
    return accepted(request_id, status)
