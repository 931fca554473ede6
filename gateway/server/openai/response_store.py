"""What the Responses API keeps of a stored response, in MongoDB (collection `responses`),
beside the request's own durable record: the settings the response object echoes and its
outputs are read with (tools, tool choice, sampling, text format), its own input items (with
ids), and the chain of responses before it (previous_response_id). Its output is not kept
here: it is read from the request's record whenever it is needed, so a response that ends
on any gateway, or after a restart, is in the chain as it ended.

Each document belongs to one tenant (another tenant's id reads as unknown) and expires with
the records (RESULT_RETENTION_S). A deleted response keeps only its id, tenant and expiry,
so that it reads as deleted rather than falling back to its bare record; `store: false`
keeps no document at all (its record says so in its labels). Conversations (the
Conversations API) are kept here too (ConversationStore)."""

from __future__ import annotations

import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from gateway.server.services import Services

COLLECTION = "responses"
# Responses one chain may hold (previous_response_id after previous_response_id).
MAX_CHAIN = 1000

_prepared: set[tuple[int, str]] = set()


class ResponseStore:
    def __init__(self, svc: Services) -> None:
        result_store = svc.store
        self.database = result_store.database
        self.client = result_store.client
        self.collection: AsyncCollection = self.client[self.database][COLLECTION]
        self.retention = timedelta(seconds=svc.settings.result_retention_s)

    async def prepare(self) -> None:
        """Its indexes, once per process and database."""
        key = (id(self.client), self.database)
        if key in _prepared:
            return
        await self.collection.create_index("expires_at", expireAfterSeconds=0)
        _prepared.add(key)

    async def put(self, tenant: str, response_id: str, document: dict[str, Any]) -> None:
        """Store (or store again: an Idempotency-Key's retry names the same response)."""
        await self.prepare()
        now = time.time()
        fields = {
            **document,
            "tenant": tenant,
            "created_at": int(now),
            "expires_at": datetime.fromtimestamp(now, UTC) + self.retention,
            "deleted": False,
        }
        # ($set with upsert: what the local MongoDB-wire server takes for a replace.)
        await self.collection.update_one({"_id": response_id}, {"$set": fields}, upsert=True)

    async def get(self, tenant: str, response_id: str) -> dict[str, Any] | None:
        """The response's document, deleted ones included (None: none was kept)."""
        found = await self.collection.find_one({"_id": response_id, "tenant": tenant})
        return dict(found) if found else None

    async def get_many(self, tenant: str, response_ids: list[str]) -> dict[str, dict[str, Any]]:
        if not response_ids:
            return {}
        found: dict[str, dict[str, Any]] = {}
        async for document in self.collection.find({"_id": {"$in": response_ids}, "tenant": tenant}):
            found[str(document["_id"])] = dict(document)
        return found

    async def delete(self, tenant: str, response_id: str) -> None:
        """Forget what was kept of the response: a tombstone stays until it expires (also for
        one that had no document, so that it reads as deleted, not as its bare record)."""
        await self.prepare()
        fields = {
            "tenant": tenant,
            "deleted": True,
            "settings": {},
            "input": [],
            "chain": [],
            "expires_at": datetime.now(UTC) + self.retention,
        }
        await self.collection.update_one({"_id": response_id}, {"$set": fields}, upsert=True)


CONVERSATIONS = "conversations"
ENTRIES = "conversation_items"


def new_conversation_id() -> str:
    return f"conv_{secrets.token_hex(24)}"


class ConversationStore:
    """Conversations (OpenAI's Conversations API) in MongoDB: a conversation, then its
    entries in order, each an item added to it or a response made in it (whose input and
    output items are read from the response's document and record, like a chain's). An
    item of a response that is deleted from the conversation is hidden in its entry."""

    def __init__(self, svc: Services) -> None:
        database = svc.store.client[svc.store.database]
        self.conversations: AsyncCollection = database[CONVERSATIONS]
        self.entries: AsyncCollection = database[ENTRIES]
        self.retention = timedelta(seconds=svc.settings.result_retention_s)

    def _expiry(self) -> datetime:
        return datetime.now(UTC) + self.retention

    async def create(self, tenant: str, metadata: dict[str, str]) -> dict[str, Any]:
        document = {
            "_id": new_conversation_id(),
            "tenant": tenant,
            "created_at": int(time.time()),
            "metadata": metadata,
            "expires_at": self._expiry(),
        }
        await self.conversations.insert_one(document)
        return document

    async def get(self, tenant: str, conversation_id: str) -> dict[str, Any] | None:
        found = await self.conversations.find_one({"_id": conversation_id, "tenant": tenant})
        return dict(found) if found else None

    async def update(self, tenant: str, conversation_id: str, metadata: dict[str, str]) -> None:
        await self.conversations.update_one(
            {"_id": conversation_id, "tenant": tenant}, {"$set": {"metadata": metadata, "expires_at": self._expiry()}}
        )

    async def delete(self, tenant: str, conversation_id: str) -> None:
        await self.entries.delete_many({"conversation": conversation_id, "tenant": tenant})
        await self.conversations.delete_one({"_id": conversation_id, "tenant": tenant})

    async def append(self, tenant: str, conversation_id: str, entries: list[dict[str, Any]]) -> list[str]:
        """Add entries ({"item": ...} or {"response": id}) at the end; their ids, in order."""
        now = time.time_ns()
        documents = [
            {
                "_id": f"{conversation_id}:{now + n:020d}:{secrets.token_hex(4)}",
                "conversation": conversation_id,
                "tenant": tenant,
                "hidden": [],
                **entry,
            }
            for n, entry in enumerate(entries)
        ]
        if documents:
            await self.entries.insert_many(documents)
            await self.conversations.update_one({"_id": conversation_id}, {"$set": {"expires_at": self._expiry()}})
        return [str(document["_id"]) for document in documents]

    async def list(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        query = {"conversation": conversation_id, "tenant": tenant}
        return [dict(document) async for document in self.entries.find(query).sort("_id", 1)]

    async def remove(self, tenant: str, entry: dict[str, Any], item_id: str) -> None:
        """Take an item out: its entry if it was added as an item, else hidden in its entry."""
        if "item" in entry:
            await self.entries.delete_one({"_id": entry["_id"], "tenant": tenant})
        else:
            hidden = [*entry.get("hidden", []), item_id]
            await self.entries.update_one({"_id": entry["_id"], "tenant": tenant}, {"$set": {"hidden": hidden}})
