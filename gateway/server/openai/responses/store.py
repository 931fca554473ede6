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
Conversations API) are kept here too (ConversationStore).

A `store: false` response made over a WebSocket can be resumed on another socket while
Redis holds its events: its settings (tools, tool choice, instructions, ...: what the
resumed response object echoes and how its output is read) are kept in Redis for that
while only (UnstoredSettings), never in MongoDB."""

from __future__ import annotations

import json
import secrets
import time
from datetime import UTC, datetime, timedelta
from typing import Any

from pymongo.asynchronous.collection import AsyncCollection

from gateway.server.api.errors import ApiError
from gateway.server.services import Services

COLLECTION = "responses"

_prepared: set[tuple[int, str]] = set()


# How long past its request's deadline a store: false response's settings stay in Redis: its
# events are resumable until the binder stored its record and RESULTS_KEEP_S (30 s) more.
UNSTORED_KEEP_S = 120


class UnstoredSettings:
    """The settings of a resumable store: false response, in Redis until UNSTORED_KEEP_S
    past its deadline (a resume after that echoes what its record says)."""

    def __init__(self, svc: Services) -> None:
        self.redis = svc.redis

    @staticmethod
    def _key(tenant: str, request_id: str) -> str:
        return f"responses:unstored:{tenant}:{request_id}"

    async def put(self, tenant: str, request_id: str, settings: dict[str, Any], timeout_s: float) -> None:
        value = json.dumps(settings, ensure_ascii=False, separators=(",", ":"))
        await self.redis.set(self._key(tenant, request_id), value, ex=int(timeout_s) + UNSTORED_KEEP_S)

    async def get(self, tenant: str, request_id: str) -> dict[str, Any] | None:
        found = await self.redis.get(self._key(tenant, request_id))
        return json.loads(found) if found else None


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

_conversations_prepared: set[tuple[int, str]] = set()


def new_conversation_id() -> str:
    return f"conv_{secrets.token_hex(24)}"


def item_bytes(item: dict[str, Any]) -> int:
    """What an item weighs against the bytes limits: its JSON, UTF-8."""
    return len(json.dumps(item, ensure_ascii=False, separators=(",", ":")).encode())


def item_entry(item: dict[str, Any]) -> dict[str, Any]:
    """The entry of an item added to a conversation."""
    return {"item": item, "ids": [item["id"]], "items": 1, "bytes": item_bytes(item)}


def response_entry(response_id: str, given: list[dict[str, Any]], output_id: str, calls: int) -> dict[str, Any]:
    """The entry of a response made in a conversation: its input items count, and one item
    for its output (how many it has is known only when it ends). `ids`: the ids known now
    (its input's, its message's); `calls`: how many function calls its output may hold
    (their ids are found from the response's id)."""
    ids = [str(item["id"]) for item in given] + [output_id]
    size = sum(item_bytes(item) for item in given)
    return {"response": response_id, "ids": ids, "items": len(given) + 1, "bytes": size, "calls": calls}


class ConversationStore:
    """Conversations (OpenAI's Conversations API) in MongoDB: a conversation, then its
    entries in order (`position`), each an item added to it or a response made in it (whose
    input and output items are read from the response's document and record, like a
    chain's). An item of a response that is deleted from the conversation is hidden in its
    entry.

    Lifetime: a conversation and the items added to it expire RESULT_RETENTION_S after it
    was last changed (created, items added, a response made in it, its metadata updated);
    a response's entry expires with the response (RESULT_RETENTION_S after it was made),
    and a response that has expired is no longer in the conversation (TTL indexes on
    `expires_at`). The conversation keeps running totals of its items and bytes (`items`,
    `bytes`), reserved before an entry is added: at most CONVERSATION_MAX_ITEMS and
    CONVERSATION_MAX_BYTES."""

    def __init__(self, svc: Services) -> None:
        database = svc.store.client[svc.store.database]
        self.key = (id(svc.store.client), svc.store.database)
        self.conversations: AsyncCollection = database[CONVERSATIONS]
        self.entries: AsyncCollection = database[ENTRIES]
        self.retention = timedelta(seconds=svc.settings.result_retention_s)
        self.max_items = svc.settings.conversation_max_items
        self.max_bytes = svc.settings.conversation_max_bytes

    async def prepare(self) -> None:
        """Its indexes (once per process and database): the TTLs, and one for each query
        on the entries (a conversation's in order; the entry holding an item)."""
        if self.key in _conversations_prepared:
            return
        await self.conversations.create_index("expires_at", expireAfterSeconds=0)
        await self.entries.create_index("expires_at", expireAfterSeconds=0)
        await self.entries.create_index([("conversation", 1), ("position", 1)])
        await self.entries.create_index([("conversation", 1), ("ids", 1)])
        _conversations_prepared.add(self.key)

    def _expiry(self) -> datetime:
        return datetime.now(UTC) + self.retention

    async def create(self, tenant: str, metadata: dict[str, str]) -> dict[str, Any]:
        await self.prepare()
        document = {
            "_id": new_conversation_id(),
            "tenant": tenant,
            "created_at": int(time.time()),
            "metadata": metadata,
            "expires_at": self._expiry(),
            "items": 0,
            "bytes": 0,
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
        await self._renew_items(tenant, conversation_id)

    async def delete(self, tenant: str, conversation_id: str) -> None:
        await self.entries.delete_many({"conversation": conversation_id, "tenant": tenant})
        await self.conversations.delete_one({"_id": conversation_id, "tenant": tenant})

    async def _renew_items(self, tenant: str, conversation_id: str) -> None:
        """The items added to it live as long as the conversation (a response's entry keeps
        its response's expiry)."""
        query = {"conversation": conversation_id, "tenant": tenant, "item": {"$exists": True}}
        await self.entries.update_many(query, {"$set": {"expires_at": self._expiry()}})

    async def append(self, tenant: str, conversation_id: str, entries: list[dict[str, Any]]) -> list[str]:
        """Add entries (item_entry, response_entry) at the end, within the limits; their ids
        (conversation:position), in order."""
        if not entries:
            return []
        await self.prepare()
        await self._reserve(tenant, conversation_id, sum(e["items"] for e in entries), sum(e["bytes"] for e in entries))
        now = time.time_ns()
        expiry = self._expiry()
        documents = []
        for n, entry in enumerate(entries):
            position = f"{now + n:020d}:{secrets.token_hex(4)}"
            documents.append(
                {
                    "_id": f"{conversation_id}:{position}",
                    "position": position,
                    "conversation": conversation_id,
                    "tenant": tenant,
                    "hidden": [],
                    "expires_at": expiry,
                    **entry,
                }
            )
        try:
            await self.entries.insert_many(documents)
        except Exception:
            await self._release(tenant, conversation_id, entries)
            raise
        await self._renew_items(tenant, conversation_id)
        return [str(document["_id"]) for document in documents]

    async def _reserve(self, tenant: str, conversation_id: str, items: int, size: int) -> None:
        """Count `items` and `size` bytes in the conversation's totals (and renew it), or
        refuse them (400 naming the limit). A total that looks over the limit is counted
        again from the entries first: responses that expired left it, and a conversation
        kept before the totals were has none."""
        max_items = self.max_items or 10**12
        max_bytes = self.max_bytes or 10**15
        change = {"$inc": {"items": items, "bytes": size}, "$set": {"expires_at": self._expiry()}}
        query = {"_id": conversation_id, "tenant": tenant}
        fits = {"items": {"$lte": max_items - items}, "bytes": {"$lte": max_bytes - size}}
        for _ in range(3):
            if (await self.conversations.update_one({**query, **fits}, change)).matched_count:
                return
            found = await self.get(tenant, conversation_id)
            if found is None:
                raise ApiError(404, "conversation_not_found", f"no conversation {conversation_id}")
            held_items, held_bytes = await self._totals(tenant, conversation_id)
            if held_items + items > max_items:
                raise self._over("items", conversation_id, held_items, items, max_items)
            if held_bytes + size > max_bytes:
                raise self._over("bytes", conversation_id, held_bytes, size, max_bytes)
            # The totals as counted, unless another call changed them meanwhile (then again).
            was = {"items": found.get("items"), "bytes": found.get("bytes")}
            counted = {"items": held_items + items, "bytes": held_bytes + size, "expires_at": self._expiry()}
            if (await self.conversations.update_one({**query, **was}, {"$set": counted})).matched_count:
                return
        raise ApiError(409, "conversation_busy", f"conversation {conversation_id} is changing: try again")

    async def _release(self, tenant: str, conversation_id: str, entries: list[dict[str, Any]]) -> None:
        items = sum(int(e.get("items") or 1) for e in entries)
        size = sum(int(e.get("bytes") or 0) for e in entries)
        await self.conversations.update_one(
            {"_id": conversation_id, "tenant": tenant}, {"$inc": {"items": -items, "bytes": -size}}
        )

    async def _totals(self, tenant: str, conversation_id: str) -> tuple[int, int]:
        """Items and bytes of its entries, counted (their counts only are read)."""
        items = size = 0
        query = {"conversation": conversation_id, "tenant": tenant}
        async for entry in self.entries.find(query, {"items": 1, "bytes": 1}):
            items += int(entry.get("items") or 1)
            size += int(entry.get("bytes") or 0)
        return items, size

    @staticmethod
    def _over(limit: str, conversation_id: str, held: int, adding: int, most: int) -> ApiError:
        setting = f"CONVERSATION_MAX_{limit.upper()}"
        return ApiError(
            400,
            f"conversation_{limit}_limit",
            f"conversation {conversation_id} holds {held} {limit}; {adding} more would pass its limit of {most} "
            f"({setting}): delete items, or start a new conversation",
            details={"limit": setting.lower(), "max": most},
        )

    async def page(
        self,
        tenant: str,
        conversation_id: str,
        *,
        after: str | None = None,
        before: str | None = None,
        descending: bool = False,
        limit: int = 0,
        without_items: bool = False,
    ) -> list[dict[str, Any]]:
        """Entries in order of position (newest first when descending), those after
        position `after` in that order and before position `before`; at most `limit`
        (0: no limit). without_items: the added items' content is not read."""
        query: dict[str, Any] = {"conversation": conversation_id, "tenant": tenant}
        bounds: dict[str, str] = {}
        if after is not None:
            bounds["$lt" if descending else "$gt"] = after
        if before is not None:
            bounds["$lt"] = min(before, bounds.get("$lt", before))
        if bounds:
            query["position"] = bounds
        cursor = self.entries.find(query, {"item": 0} if without_items else None)
        cursor = cursor.sort("position", -1 if descending else 1)
        if limit:
            cursor = cursor.limit(limit)
        return [dict(entry) async for entry in cursor]

    async def entry_holding(self, tenant: str, conversation_id: str, item_id: str) -> dict[str, Any] | None:
        """The entry whose known ids include `item_id`."""
        query = {"conversation": conversation_id, "tenant": tenant, "ids": {"$in": [item_id]}}
        found = await self.entries.find_one(query)
        return dict(found) if found else None

    async def entries_with_calls(self, tenant: str, conversation_id: str) -> list[dict[str, Any]]:
        """The entries of responses whose output may hold function calls (no content read)."""
        query = {"conversation": conversation_id, "tenant": tenant, "calls": {"$gt": 0}}
        projection = {"response": 1, "calls": 1, "position": 1, "hidden": 1}
        return [dict(entry) async for entry in self.entries.find(query, projection)]

    async def remove(self, tenant: str, entry: dict[str, Any], item_id: str) -> None:
        """Take an item out: its entry if it was added as an item (and out of the totals),
        else hidden in its entry."""
        if "item" in entry:
            if (await self.entries.delete_one({"_id": entry["_id"], "tenant": tenant})).deleted_count:
                await self._release(tenant, str(entry["conversation"]), [entry])
        else:
            hidden = [*entry.get("hidden", []), item_id]
            await self.entries.update_one({"_id": entry["_id"], "tenant": tenant}, {"$set": {"hidden": hidden}})
