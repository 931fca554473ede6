"""A request's result: the answer to GET /results/<id> (poll, or long-poll with ?wait=N;
the route itself, its checks and its OpenAPI entry are gateway.server.api.hot), and the
routes to cancel it and to replay its webhook. An id that is not one of ours, or another
tenant's, is 404."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.protocol import State, valid_request_id
from gateway.protocol.http import CancelResponse
from gateway.server import spine
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.services import Services, services

router = APIRouter()

# A running request usually stops within a generation step; cancel waits this long for it.
CANCEL_WAIT_S = 5.0


def known_id(request_id: str) -> str:
    if not valid_request_id(request_id):
        raise ApiError(404, "not_found", "no such request")
    return request_id


async def result_response(svc: Services, who: Caller, request_id: str, wait: float | None) -> Response:
    """The answer to GET /results/<id>, its key and ?wait=N checked (gateway.server.api.hot)."""
    known_id(request_id)
    if wait:
        # A long poll holds a place of the tenant's share of the process's followers while
        # it waits (429 tenant_share_exceeded at once when the tenant holds it all).
        with svc.events.holding(who.tenant):
            _, body, _ = await svc.results.wait_json(request_id, min(wait, svc.settings.max_wait_s), who.scope)
    else:
        _, body, _ = await svc.results.get_json(request_id, who.scope)
    return Response(body, media_type="application/json")


@router.post(
    "/results/{request_id}/cancel",
    response_model=CancelResponse,
    summary="Cancel a request",
    responses={404: {"description": "Unknown id"}, 409: {"description": "Already finished"}},
)
async def cancel(request_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    """Queued work never runs; running work has its Triton stream cancelled."""
    svc = services(request)
    known_id(request_id)
    if await svc.results.job(request_id, who.scope) is None:
        await svc.results.get(request_id, who.scope)  # 404 or 410 ...
        raise ApiError(409, "already_finished", f"{request_id} already finished")  # ... or stored and gone from Redis
    async with svc.results.notifier.watch(request_id) as ended:
        state = await spine.cancel(svc.jobs, request_id)
        if state is None:
            raise ApiError(409, "already_finished", f"{request_id} already finished")
        if state == State.RUNNING:
            try:
                await asyncio.wait_for(ended, timeout=CANCEL_WAIT_S)
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


@router.post(
    "/results/{request_id}/webhook/replay",
    summary="Send a request's webhook again",
    responses={
        404: {"description": "No stored result"},
        409: {
            "description": "The request has no webhook (`no_webhook`), or a replay of it is pending (`replay_pending`)"
        },
        429: {"description": "The tenant's replays of the minute are used (`replay_rate_limited`, Retry-After)"},
    },
)
async def replay_webhook(request_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> Any:
    """Queue the stored result's webhook once more (same webhook-id, so receivers can de-duplicate),
    signed with the tenant's current secrets. One replay of a request is pending at a time, and a
    tenant has a few a minute (the binder's WEBHOOK_REPLAYS_PER_MINUTE, 10 by default)."""
    known_id(request_id)
    return await services(request).binders.replay_webhook(request_id, who.scope)
