"""The summaries POST /v1/responses/compact makes, in MongoDB (collection `compactions`).

A compaction item's `encrypted_content` is an opaque reference (`gwcmp1.<random>`): the
summary itself stays here, with its tenant, and expires with the records
(RESULT_RETENTION_S). Given back as input, the item is read here for the caller's tenant
only: another tenant's, or one that has expired, is refused by name
(compaction_not_found)."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from gateway.server.api.errors import ApiError
from gateway.server.services import Services

COLLECTION = "compactions"
_PREFIX = "gwcmp1."

_prepared: set[tuple[int, str]] = set()


def new_compaction() -> tuple[str, str]:
    """A new compaction item's id and the reference its encrypted_content carries."""
    token = secrets.token_urlsafe(24)
    return f"cmp_{secrets.token_hex(16)}", f"{_PREFIX}{token}"


class CompactionStore:
    def __init__(self, svc: Services) -> None:
        database = svc.store.client[svc.store.database]
        self.key = (id(svc.store.client), svc.store.database)
        self.collection: AsyncCollection = database[COLLECTION]
        self.retention = timedelta(seconds=svc.settings.result_retention_s)

    async def prepare(self) -> None:
        if self.key in _prepared:
            return
        await self.collection.create_index("expires_at", expireAfterSeconds=0)
        _prepared.add(self.key)

    async def put(self, tenant: str, reference: str, item_id: str, summary: str, model: str) -> None:
        await self.prepare()
        document = {
            "_id": reference,
            "item": item_id,
            "tenant": tenant,
            "model": model,
            "summary": summary,
            "created_at": int(time.time()),
            "expires_at": datetime.now(UTC) + self.retention,
        }
        await self.collection.insert_one(document)

    async def summaries(self, tenant: str, references: list[tuple[str, str]]) -> dict[str, str]:
        """The summary of each (param, reference), by reference; the first one not kept for
        this tenant is refused naming its place."""
        wanted = sorted({reference for _, reference in references})
        found: dict[str, str] = {}
        if wanted:
            query: dict[str, Any] = {"_id": {"$in": wanted}, "tenant": tenant}
            async for document in self.collection.find(query, {"summary": 1}):
                found[str(document["_id"])] = str(document.get("summary") or "")
        for param, reference in references:
            if reference not in found:
                raise ApiError(
                    400,
                    "compaction_not_found",
                    f"{param}: this compaction item was not made by POST /v1/responses/compact for this key's "
                    "tenant, or it has expired: compact the conversation again",
                    details={"param": param},
                )
        return found
