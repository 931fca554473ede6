"""Feeds the vector index from the results stream.

Every binder keeps a full copy of the index, so any binder can answer a search: it
reads the whole `results` stream (plain XREAD, not the consumer group, which splits
entries between binders), from the last entry its snapshot applied. Without a
snapshot, or when the stream was trimmed past that entry, it rebuilds from MongoDB
and then replays all the stream still holds (results not yet stored are there; ids
already present are skipped)."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from binder.index.vectors import VectorIndex
from gateway.common.result_store import ResultStore, embedding_from_document
from gateway.common.streams import stream_id_order
from gateway.protocol import ResultRecord
from gateway.protocol.redis_keys import RESULTS_STREAM

log = logging.getLogger(__name__)


def embedding_of(record: ResultRecord) -> tuple[str, str, list[float]] | None:
    found = record.embedding
    return (found[0], record.request_id, found[1]) if found else None


class IndexFollower:
    def __init__(
        self, redis: Redis, index: VectorIndex, store: ResultStore, *, snapshot_interval_s: float, batch: int = 512
    ) -> None:
        self.redis = redis
        self.index = index
        self.store = store
        self.snapshot_interval_s = snapshot_interval_s
        self.batch = batch
        self.caught_up = asyncio.Event()

    async def prepare(self) -> None:
        loaded = await asyncio.to_thread(self.index.load)
        if loaded and not await self._gap_after(self.index.last_id):
            log.info(
                "index snapshot loaded at %s: %s",
                self.index.last_id,
                {s: self.index.ntotal(s) for s in self.index.spaces},
            )
            return
        await self.rebuild()

    async def _gap_after(self, last_id: str) -> bool:
        """True when entries after last_id may have been trimmed from the stream."""
        if not await self.redis.exists(RESULTS_STREAM):
            return False
        first = await self.redis.xrange(RESULTS_STREAM, count=1)
        return bool(first) and stream_id_order(first[0][0]) > stream_id_order(last_id) and last_id != "0-0"

    async def rebuild(self) -> None:
        """Everything MongoDB holds; run() then replays the stream from its start."""
        started = time.monotonic()
        items = []
        async for document in self.store.embeddings():
            found = embedding_from_document(document)
            if found:
                items.append((found[0], document["_id"], found[1]))
        self.index.add(items, last_id="0-0")
        log.info("index rebuilt from MongoDB: %d vectors in %.1fs", len(items), time.monotonic() - started)

    async def run(self) -> None:
        last_snapshot = time.monotonic()
        applied_since_snapshot = 0
        while True:
            reply = await self.redis.xread({RESULTS_STREAM: self.index.last_id}, count=self.batch, block=1000)
            if not reply:
                self.caught_up.set()
            else:
                entries = reply[0][1]
                items = []
                for _, fields in entries:
                    try:
                        found = embedding_of(ResultRecord.model_validate_json(fields.get("record", "")))
                    except ValueError:
                        continue  # not a record; the storing side dead-letters it
                    if found:
                        items.append(found)
                applied_since_snapshot += self.index.add(items, last_id=entries[-1][0])
            due = time.monotonic() - last_snapshot >= self.snapshot_interval_s
            if applied_since_snapshot and due:
                await asyncio.to_thread(self.index.snapshot)
                last_snapshot, applied_since_snapshot = time.monotonic(), 0
