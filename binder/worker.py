"""Stores results: reads the `results` stream as a member of the binders' consumer
group, in batches, writes one MongoDB document per request, and acknowledges an entry
only after MongoDB acknowledged its write.

Recovery needs no lock: entries left pending by a dead binder are reclaimed with
XAUTOCLAIM once idle; an entry delivered more than max_deliveries times goes to the
dead-letter stream with its error; trimming drops only acknowledged entries."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from redis.asyncio import Redis

from binder.store import ResultStore
from binder.webhooks import WebhookQueue
from gateway.contracts import BINDER_GROUP, DEAD_LETTER_STREAM, RESULTS_STREAM, ResultRecord, request_key
from gateway.settings import BinderSettings
from gateway.streams import ensure_group, trim_acknowledged

log = logging.getLogger(__name__)

# Mark the live state as stored, but never re-create a request hash that has expired.
MARK_STORED = """
for i, key in ipairs(KEYS) do
  if redis.call('EXISTS', key) == 1 then redis.call('HSET', key, 'stored', '1') end
end
return 1
"""

# Keep results in the stream this long even once stored: the index followers of all
# binders read it, and a follower far behind rebuilds from MongoDB instead.
STREAM_KEEP_S = 3600


class ResultWorker:
    def __init__(self, redis: Redis, store: ResultStore, webhooks: WebhookQueue, settings: BinderSettings) -> None:
        self.redis = redis
        self.store = store
        self.webhooks = webhooks
        self.settings = settings
        self.consumer = settings.binder_name
        self._mark_stored = redis.register_script(MARK_STORED)
        self.stored_total = 0

    async def prepare(self) -> None:
        await ensure_group(self.redis, RESULTS_STREAM, BINDER_GROUP)

    async def run(self) -> None:
        await self._drain_own_pending()
        last_reclaim = last_trim = time.monotonic()
        while True:
            entries = await self._read(self.settings.batch_size, self.settings.block_ms)
            if entries and len(entries) < self.settings.batch_size and self.settings.linger_ms:
                await asyncio.sleep(self.settings.linger_ms / 1000)
                entries += await self._read(self.settings.batch_size - len(entries), None)
            if entries:
                await self.process(entries)
            now = time.monotonic()
            if now - last_reclaim >= self.settings.claim_idle_ms / 2000:
                last_reclaim = now
                await self.reclaim()
            if now - last_trim >= 30:
                last_trim = now
                await trim_acknowledged(self.redis, RESULTS_STREAM, BINDER_GROUP, keep_newer_than_s=STREAM_KEEP_S)

    async def _read(self, count: int, block_ms: int | None) -> list[tuple[str, dict[str, str]]]:
        reply = await self.redis.xreadgroup(BINDER_GROUP, self.consumer, {RESULTS_STREAM: ">"}, count=count, block=block_ms)
        return reply[0][1] if reply else []

    async def _drain_own_pending(self) -> None:
        """After a restart under the same name: what we had read but not acknowledged."""
        while True:
            reply = await self.redis.xreadgroup(
                BINDER_GROUP, self.consumer, {RESULTS_STREAM: "0"}, count=self.settings.batch_size
            )
            entries = reply[0][1] if reply else []
            if not entries:
                return
            acked = await self.process(entries)
            if not acked:
                return  # what is left keeps failing; reclaim() counts its deliveries

    async def process(self, entries: list[tuple[str, dict[str, str]]]) -> int:
        """Store a batch; returns how many entries were acknowledged."""
        records: dict[str, ResultRecord] = {}
        entry_of: dict[str, list[str]] = {}
        for entry_id, fields in entries:
            try:
                record = ResultRecord.model_validate_json(fields.get("record") or "")
            except ValueError:
                log.warning("entry %s is not a result record; it will be dead-lettered after retries", entry_id)
                continue
            records[record.request_id] = record  # the same request twice in a batch: once
            entry_of.setdefault(record.request_id, []).append(entry_id)
        if not records:
            return 0
        outcome = await self.store.insert(list(records.values()))
        for request_id, error in outcome.failed.items():
            log.warning("storing %s failed: %s", request_id, error)
        if not outcome.stored:
            return 0
        await self._mark_stored(keys=[request_key(rid) for rid in outcome.stored])
        await self.webhooks.enqueue([records[rid] for rid in outcome.stored])
        acked = [entry for rid in outcome.stored for entry in entry_of[rid]]
        await self.redis.xack(RESULTS_STREAM, BINDER_GROUP, *acked)
        self.stored_total += len(outcome.stored)
        return len(acked)

    async def reclaim(self) -> None:
        """Take over entries idle past claim_idle_ms (their binder died, or they keep
        failing); dead-letter those delivered too often."""
        reply = await self.redis.xautoclaim(
            RESULTS_STREAM, BINDER_GROUP, self.consumer, self.settings.claim_idle_ms, "0-0",
            count=self.settings.batch_size,
        )
        entries = [(entry_id, fields) for entry_id, fields in reply[1] if fields]
        if not entries:
            return
        ids = [entry_id for entry_id, _ in entries]
        details = await self.redis.xpending_range(
            RESULTS_STREAM, BINDER_GROUP, min=ids[0], max=ids[-1], count=len(ids) * 2, consumername=self.consumer
        )
        deliveries = {d["message_id"]: d["times_delivered"] for d in details}
        retry = []
        for entry_id, fields in entries:
            if deliveries.get(entry_id, 0) > self.settings.max_deliveries:
                await self._dead_letter(entry_id, fields, deliveries[entry_id])
            else:
                retry.append((entry_id, fields))
        if retry:
            log.info("reclaimed %d result entries", len(retry))
            await self.process(retry)

    async def _dead_letter(self, entry_id: str, fields: dict[str, str], deliveries: int) -> None:
        error = "not a result record"
        try:
            ResultRecord.model_validate_json(fields.get("record") or "")
            error = "storing failed repeatedly"
        except ValueError as exc:
            error = f"not a result record: {str(exc).splitlines()[0]}"
        await self.redis.xadd(
            DEAD_LETTER_STREAM,
            {"entry": entry_id, "fields": json.dumps(fields), "error": error, "deliveries": deliveries},
        )
        await self.redis.xack(RESULTS_STREAM, BINDER_GROUP, entry_id)
        log.error("result entry %s dead-lettered after %d deliveries: %s", entry_id, deliveries, error)

