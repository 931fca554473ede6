"""Operations: liveness, readiness, Prometheus metrics, and the models served."""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.services import Services, services

router = APIRouter()

CHECK_TIMEOUT_S = 2.0
READY_CACHE_S = 1.0


@router.get("/healthz", summary="Liveness")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    summary="Readiness: Redis and MongoDB reachable, a Triton replica ready",
    responses={503: {"description": "redis_unavailable, mongo_unavailable or no_replica"}},
)
async def readyz(request: Request) -> Any:
    """Answered from one check a second at most, shared by the calls that come meanwhile:
    the path is public, and each call would otherwise cost a Redis and a MongoDB round trip."""
    state = request.app.state
    now = time.monotonic()
    last: tuple[float, asyncio.Future[Any]] | None = getattr(state, "readiness", None)
    if last is None or now - last[0] >= READY_CACHE_S:
        last = state.readiness = (now, asyncio.ensure_future(_readiness(services(request))))
    answer = await asyncio.shield(last[1])  # a caller gone does not cancel the others' check
    if isinstance(answer, ApiError):  # a new one each call: a raised instance keeps its traceback
        raise ApiError(answer.status, answer.code, answer.message)
    return answer


async def _readiness(svc: Services) -> dict[str, Any] | ApiError:
    try:
        return await _check(svc)
    except ApiError as exc:
        return exc


async def _check(svc: Services) -> dict[str, Any]:
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            await svc.redis.ping()
    except Exception:
        raise ApiError(503, "redis_unavailable", "Redis is not answering") from None
    try:
        async with asyncio.timeout(CHECK_TIMEOUT_S):
            await svc.store.ping()
    except Exception:
        raise ApiError(503, "mongo_unavailable", "MongoDB is not answering") from None
    if not svc.pool.ready():
        raise ApiError(503, "no_replica", "no Triton replica is ready")
    ready = sum(1 for r in svc.pool.replicas if r.healthy and not r.removed)
    return {"status": "ready", "replicas_ready": ready}


@router.get("/models", summary="The models this gateway serves")
async def models(request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    svc = services(request)
    return {"models": [adapter.describe() for _, adapter in sorted(svc.registry.adapters.items())]}


@router.get("/metrics", summary="Prometheus metrics (public unless PUBLIC_METRICS=false)")
async def metrics(request: Request) -> Response:
    if not services(request).settings.public_metrics:
        await caller(request)
    return Response(generate_latest(services(request).metrics.registry), media_type=CONTENT_TYPE_LATEST)
