"""Results in MongoDB: one document per request_id (the unique _id), kept until
expires_at (TTL index). A duplicate-key error on insert means "already stored", which
makes every write idempotent however often a result is delivered."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pymongo import AsyncMongoClient, WriteConcern
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import BulkWriteError

from gateway.contracts import RESULTS_COLLECTION, ResultRecord, record_to_document

log = logging.getLogger(__name__)

DUPLICATE_KEY = 11000


@dataclass
class InsertOutcome:
    stored: list[str] = field(default_factory=list)  # request ids now in MongoDB (new or already there)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error


class ResultStore:
    def __init__(self, client: AsyncMongoClient, database: str, retention_s: int) -> None:
        self.client = client
        self.database = database
        self.retention = timedelta(seconds=retention_s)
        self.collection: AsyncCollection = client[database][RESULTS_COLLECTION]

    async def prepare(self) -> None:
        """Indexes, and majority writes where the server is a replica set."""
        hello = await self.client.admin.command("hello")
        if hello.get("setName"):
            self.collection = self.client[self.database].get_collection(
                RESULTS_COLLECTION, write_concern=WriteConcern("majority")
            )
        await self.collection.create_index("expires_at", expireAfterSeconds=0)
        await self.collection.create_index([("model", 1), ("created_at", -1)])

    def document(self, record: ResultRecord) -> dict[str, Any]:
        finished = record.finished_at or record.created_at
        stored = record.model_copy(update={"stored": True, "expires_at": finished + self.retention})
        return record_to_document(stored)

    async def insert(self, records: list[ResultRecord]) -> InsertOutcome:
        outcome = InsertOutcome()
        if not records:
            return outcome
        try:
            await self.collection.insert_many([self.document(r) for r in records], ordered=False)
        except BulkWriteError as exc:
            for error in exc.details.get("writeErrors", []):
                if error.get("code") != DUPLICATE_KEY:
                    outcome.failed[records[error["index"]].request_id] = error.get("errmsg", "write failed")
        outcome.stored = [r.request_id for r in records if r.request_id not in outcome.failed]
        return outcome

    async def set_webhook_status(self, request_id: str, status: str, attempts: list[dict[str, Any]]) -> None:
        # The whole list is set (not $push) so a retried update cannot append twice.
        await self.collection.update_one(
            {"_id": request_id}, {"$set": {"webhook_status": status, "webhook_attempts": attempts}}
        )

    async def embeddings(self, models: list[str]) -> Any:
        """Every stored succeeded result of these models (for rebuilding the index)."""
        return self.collection.find(
            {"model": {"$in": models}, "status": "succeeded"}, {"request_id": 1, "model": 1, "outputs": 1}
        )
