"""The Batch API (OpenAI's shapes): POST /v1/batches, GET /v1/batches/{id},
GET /v1/batches (after, limit), POST /v1/batches/{id}/cancel.

A batch is a document in MongoDB (`batches`), its lines documents in `batch_lines`;
nothing of it lives only in a gateway's memory. Any gateway drives it while it holds
its lease (gateway.server.openai.files.batch_runner): the lines become ordinary durable
requests in the `batch` band, below interactive traffic, so batches fill spare capacity.

Statuses: validating -> in_progress -> finalizing -> completed | failed | expired, and
cancelling -> cancelled. An invalid line goes to the error file and does not fail the
batch; a batch fails only when its input cannot be read at all (or its lines would take
its tenant past TENANT_MAX_BATCH_LINES, or its validation never ended
BATCH_MAX_VALIDATIONS times). A tenant has at most TENANT_MAX_ACTIVE_BATCHES batches not
ended (429 active_batches_quota_exceeded beyond), each create reserved atomically beside
the others in flight (gateway.server.tenants.reservations): concurrent creates against a
quota of N make N at most."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai.files.batch_store import QUOTA_RETRY_AFTER_S, WINDOWS
from gateway.server.openai.paging import listing
from gateway.server.openai.schemas import BATCH_ENDPOINTS, BatchRequest, refuse_unsupported
from gateway.server.services import Services, services
from gateway.server.tenants.reservations import Over, now_ms, reserve

router = APIRouter(prefix="/v1", tags=["OpenAI"])

# Fields of a batch document that are not part of the OpenAI batch object.
_PRIVATE = ("tenant", "lease_owner", "lease_until", "ending", "validations")


def batch_object(document: dict[str, Any]) -> dict[str, Any]:
    found = {k: v for k, v in document.items() if k not in _PRIVATE and k != "_id"}
    return {"id": document["_id"], **found}


def _not_found(batch_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no batch {batch_id}", details={"param": "batch_id"})


@router.post("/batches", summary="Create a batch (OpenAI)")
async def create_batch(body: BatchRequest, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    svc = services(request)
    refuse_unsupported(body, "batches")
    if body.endpoint not in BATCH_ENDPOINTS:
        raise ApiError(
            400,
            "invalid_endpoint",
            f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}",
            details={"param": "endpoint"},
        )
    if body.completion_window not in WINDOWS:
        raise ApiError(
            400, "invalid_completion_window", "completion_window must be 24h", details={"param": "completion_window"}
        )
    found = await svc.files.get(who.tenant, body.input_file_id)
    if found is None:
        raise ApiError(404, "not_found", f"no file {body.input_file_id}", details={"param": "input_file_id"})
    if found["purpose"] != "batch":
        raise ApiError(
            400, "invalid_file", "the input file must have purpose batch", details={"param": "input_file_id"}
        )
    async with batch_reserved(svc, who.tenant):
        document = await svc.batches.create(who.tenant, body)
    svc.batch_runner.notice()
    return batch_object(document)


# The batches of a tenant being created now: they count against its quota beside those
# not ended (gateway.server.tenants.reservations).
RESERVATIONS_KEY = "batches:reserved:{{{tenant}}}"


@asynccontextmanager
async def batch_reserved(svc: Services, tenant: str) -> AsyncIterator[None]:
    """A batch reserved against the tenant's TENANT_MAX_ACTIVE_BATCHES (0: no limit) while
    the block creates it, atomically beside the other creates in flight: 429 when it does
    not fit beside the tenant's batches not ended (one that ends makes room)."""
    limit = svc.settings.tenant_max_active_batches
    if not limit:
        yield
        return
    await svc.batches.prepare()
    counted_at_ms = now_ms()
    active = await svc.batches.active(tenant)
    key = RESERVATIONS_KEY.format(tenant=tenant)
    reserved = await reserve(
        svc.redis, key, kept=active, kept_bytes=0, counted_at_ms=counted_at_ms, size=0, max_count=limit, max_bytes=0
    )
    if isinstance(reserved, Over):
        raise ApiError(
            429,
            "active_batches_quota_exceeded",
            f"tenant {tenant} has or is creating {reserved.used} batches not ended, its quota "
            f"(TENANT_MAX_ACTIVE_BATCHES) is {limit}",
            details={"quota": "TENANT_MAX_ACTIVE_BATCHES", "limit": limit, "used": reserved.used},
            headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)},
        )
    try:
        yield
    finally:
        await reserved.release()


@router.get("/batches/{batch_id}", summary="One batch (OpenAI)")
async def get_batch(batch_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    document = await services(request).batches.get(who.tenant, batch_id)
    if document is None:
        raise _not_found(batch_id)
    return batch_object(document)


@router.get("/batches", summary="The tenant's batches, newest first (OpenAI)")
async def list_batches(
    request: Request,
    who: Annotated[Caller, Depends(caller)],
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    documents = await services(request).batches.list(who.tenant, limit + 1, after)
    return listing([batch_object(d) for d in documents[:limit]], len(documents) > limit)


@router.post("/batches/{batch_id}/cancel", summary="Cancel a batch (OpenAI)")
async def cancel_batch(batch_id: str, request: Request, who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
    svc = services(request)
    document = await svc.batches.cancel(who.tenant, batch_id)
    if document is None:
        existing = await svc.batches.get(who.tenant, batch_id)
        if existing is None:
            raise _not_found(batch_id)
        if existing["status"] not in ("cancelling", "cancelled"):
            raise ApiError(409, "batch_not_cancellable", f"the batch is {existing['status']}")
        return batch_object(existing)
    svc.batch_runner.notice()
    return batch_object(document)
