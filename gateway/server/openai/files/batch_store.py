"""The Batch API's documents in MongoDB: batches (`batches`), their lines (`batch_lines`)
and the runners' turns between tenants (`batch_turns`); batches.py says what a batch is."""

from __future__ import annotations

import time
from typing import Any

from pymongo import AsyncMongoClient, ReturnDocument

from gateway.protocol import new_request_id
from gateway.server.openai.schemas import BatchRequest

BATCHES_COLLECTION = "batches"
LINES_COLLECTION = "batch_lines"
# When each tenant's batches were last claimed by a runner (round robin between tenants).
TURNS_COLLECTION = "batch_turns"
WINDOWS = {"24h": 24 * 3600}
# A runner works on a batch in these statuses.
ACTIVE = ("validating", "in_progress", "cancelling", "finalizing")
# What a line is: waiting to be submitted, submitted (its requests run), or ended.
PENDING, SUBMITTED, SUCCEEDED, FAILED, SKIPPED = "pending", "submitted", "succeeded", "failed", "skipped"

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
