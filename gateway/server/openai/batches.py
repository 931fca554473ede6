"""The Batch API (OpenAI's shapes): POST /v1/batches, GET /v1/batches/{id},
GET /v1/batches (after, limit), POST /v1/batches/{id}/cancel.

A batch is a document in MongoDB (`batches`), its lines documents in `batch_lines`;
nothing of it lives only in a gateway's memory. Any gateway drives it while it holds
its lease (gateway.server.openai.batch_runner): the lines become ordinary durable
requests in the `batch` band, below interactive traffic, so batches fill spare capacity.

Statuses: validating -> in_progress -> finalizing -> completed | failed | expired, and
cancelling -> cancelled. An invalid line goes to the error file and does not fail the
batch; a batch fails only when its input cannot be read at all (or its lines would take
its tenant past TENANT_MAX_BATCH_LINES, or its validation never ended
BATCH_MAX_VALIDATIONS times). A tenant has at most TENANT_MAX_ACTIVE_BATCHES batches not
ended (429 active_batches_quota_exceeded beyond)."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from pymongo import AsyncMongoClient, ReturnDocument

from gateway.protocol import new_request_id
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, caller
from gateway.server.openai.schemas import BATCH_ENDPOINTS, BatchRequest, refuse_unsupported
from gateway.server.services import Services, services

router = APIRouter(prefix="/v1", tags=["OpenAI"])

BATCHES_COLLECTION = "batches"
LINES_COLLECTION = "batch_lines"
# When each tenant's batches were last claimed by a runner (round robin between tenants).
TURNS_COLLECTION = "batch_turns"
WINDOWS = {"24h": 24 * 3600}
# A runner works on a batch in these statuses.
ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")
# What a line is: waiting to be submitted, submitted (its requests run), or ended.
PENDING, SUBMITTED, SUCCEEDED, FAILED, SKIPPED = "pending", "submitted", "succeeded", "failed", "skipped"

# Fields of a batch document that are not part of the OpenAI batch object.
_PRIVATE = ("tenant", "lease_owner", "lease_until", "ending", "validations")
# Retry-After of a batch refused for the tenant's active batches: batches take minutes.
QUOTA_RETRY_AFTER_S = 60


class BatchStore:
    def __init__(self, client: AsyncMongoClient, database: str) -> None:
        self.batches = client[database][BATCHES_COLLECTION]
        self.lines = client[database][LINES_COLLECTION]
        self.turns = client[database][TURNS_COLLECTION]
        self._prepared = False

    async def prepare(self) -> None:
        """The indexes of every query a hot path makes (once per store): a runner's claim
        (active batches of a tenant, oldest first), a tenant's list and its active count,
        and a batch's lines by outcome and in order. Without them one tenant's volume is a
        full scan for everyone."""
        if self._prepared:
            return
        # (No `_id` in a compound key: the local MongoDB-wire server refuses one.)
        await self.batches.create_index([("status", 1), ("tenant", 1), ("created_at", 1)])
        await self.batches.create_index([("tenant", 1), ("created_at", -1)])
        await self.lines.create_index([("batch", 1), ("outcome", 1), ("line", 1)])
        await self.lines.create_index([("batch", 1), ("line", 1)])
        self._prepared = True

    async def active(self, tenant: str) -> int:
        """The tenant's batches not ended yet."""
        return await self.batches.count_documents({"status": {"$in": list(ACTIVE)}, "tenant": tenant})

    async def create(self, tenant: str, body: BatchRequest) -> dict[str, Any]:
        now = int(time.time())
        document: dict[str, Any] = {
            "_id": f"batch_{new_request_id()}",
            "object": "batch",
            "tenant": tenant,
            "endpoint": body.endpoint,
            "errors": None,
            "input_file_id": body.input_file_id,
            "completion_window": body.completion_window,
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + WINDOWS[body.completion_window],
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": body.metadata,
            "lease_owner": "",
            "lease_until": 0.0,
        }
        await self.batches.insert_one(document)
        return document

    async def get(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        return await self.batches.find_one({"_id": batch_id, "tenant": tenant})

    async def list(self, tenant: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        query: dict[str, Any] = {"tenant": tenant}
        if after:
            query["_id"] = {"$lt": after}  # ids grow with time: newest first, then older
        return [document async for document in self.batches.find(query).sort("_id", -1).limit(limit)]

    async def cancel(self, tenant: str, batch_id: str) -> dict[str, Any] | None:
        return await self.batches.find_one_and_update(
            {"_id": batch_id, "tenant": tenant, "status": {"$in": ["validating", "in_progress"]}},
            {"$set": {"status": "cancelling", "cancelling_at": int(time.time())}},
            return_document=ReturnDocument.AFTER,
        )


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
    await refuse_over_quota(svc, who.tenant)
    document = await svc.batches.create(who.tenant, body)
    svc.batch_runner.notice()
    return batch_object(document)


async def refuse_over_quota(svc: Services, tenant: str) -> None:
    """Refuse (429) a batch beyond the tenant's TENANT_MAX_ACTIVE_BATCHES not ended yet (0:
    no limit): one that ends makes room. Batches created at the same moment may pass it
    together."""
    limit = svc.settings.tenant_max_active_batches
    if not limit:
        return
    await svc.batches.prepare()
    active = await svc.batches.active(tenant)
    if active >= limit:
        raise ApiError(
            429,
            "active_batches_quota_exceeded",
            f"tenant {tenant} has {active} batches not ended, its quota (TENANT_MAX_ACTIVE_BATCHES) is {limit}",
            details={"quota": "TENANT_MAX_ACTIVE_BATCHES", "limit": limit, "used": active},
            headers={"Retry-After": str(QUOTA_RETRY_AFTER_S)},
        )


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
    data = [batch_object(d) for d in documents[:limit]]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(documents) > limit,
    }


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
