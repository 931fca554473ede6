"""Feeds the vector index from the results streams (one per Redis shard).

Every binder keeps a full copy of the index (with INDEX_PARTITIONS > 1, of its
partition's tenants: binder.settings), so any binder of a tenant's partition can answer
its searches: it reads every shard's whole `results` stream (plain XREAD, not the
consumer group, which splits entries between binders), each from the last entry its
snapshot applied. Without
a snapshot, or when a stream was trimmed past that entry, it rebuilds from MongoDB and
then replays all the streams still hold (results not yet stored are there; ids already
present are skipped). The gap check runs at start and then every GAP_CHECK_EVERY_S while
it follows: a follower whose positions the archiver stopped seeing (reports failing or
late for half of READER_LIVE_S) may have been trimmed past, and then rebuilds the same way
(trimmed entries were stored first, so MongoDB has them).

A many-input request's record holds its vectors packed (gateway.protocol.vectors): each
row is indexed as its own vector, keyed `<request id>#<row>`, fed from the record's one
float32 buffer. Each vector keeps its result's tenant and expiry (the expires_at MongoDB's TTL acts
on, computed the way the store computes it), so searches stay within a tenant and
the index forgets what MongoDB forgets.

The index is touched only from worker threads (to_thread): its lock is then never
waited for on the event loop, which also serves /healthz, the archiver and webhooks.
Snapshots run in the background while indexing goes on."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from datetime import datetime

import numpy as np
from redis.asyncio import Redis

from binder.archive import READER_LIVE_S
from binder.index.vectors import NEVER, Item, VectorIndex, row_key
from gateway.common.result_store import ResultStore, embedding_from_document, expiry_of
from gateway.common.streams import stream_id_order
from gateway.protocol import ResultRecord, State
from gateway.protocol.records import DEFAULT_TENANT
from gateway.protocol.redis_keys import Shard
from gateway.protocol.vectors import is_packed, packed_bytes, packed_shape

log = logging.getLogger(__name__)

# How often vectors marked expired are removed from FAISS (searches skip them meanwhile).
SWEEP_EVERY_S = 10.0
# How often the follower says how far it has read (the archiver's trimming waits for it).
READ_POSITION_S = 2.0
# How often a running follower checks that no stream was trimmed past what it applied.
GAP_CHECK_EVERY_S = 30.0
# Reports this far apart (or none) and the archiver may have stopped waiting for this
# follower: entries it had not read may have been trimmed.
_REPORTS_LATE_S = READER_LIVE_S / 2


# The index forgets a vector this long before its record's expires_at: TTL monitors and
# clocks differ between hosts (nx-27017's monitor deletes up to a second early), and a
# hit must never point at a record MongoDB no longer has.
EXPIRY_MARGIN_S = 2.0


def forget_at(moment: datetime) -> float:
    """When the index forgets a result expiring at moment, in epoch seconds: as MongoDB keeps
    it (milliseconds, rounded down), less the margin."""
    return math.floor(moment.timestamp() * 1000) / 1000 - EXPIRY_MARGIN_S


def packed_items(space: str, tenant: str, request_id: str, value: dict, expires: float) -> list[Item]:
    """One item per row of a many-input request's packed vectors (gateway.protocol.vectors),
    each a view of the one float32 buffer (FAISS copies them once, stacked)."""
    rows, dim = packed_shape(value)
    matrix = np.frombuffer(packed_bytes(value), dtype="<f4").reshape(rows, dim)
    return [Item(space, tenant, row_key(request_id, row), matrix[row], expires) for row in range(rows)]


def item_of(record: ResultRecord, store: ResultStore) -> list[Item]:
    """The record's vectors to index: none, its one vector, or one per input of a
    many-input request."""
    index, outputs = record.index, record.outputs
    if record.status != State.SUCCEEDED or index is None or not outputs:
        return []
    value = outputs.get(index.output)
    if not value:
        return []
    expires = forget_at(expiry_of(record, store.retention))
    if is_packed(value):
        return packed_items(index.space, record.tenant, record.request_id, value, expires)
    return [Item(index.space, record.tenant, record.request_id, value, expires)]


def item_from_document(document: dict) -> list[Item]:
    expires = document.get("expires_at")
    at = forget_at(expires) if isinstance(expires, datetime) else NEVER
    tenant = document.get("tenant") or DEFAULT_TENANT
    index, outputs = document.get("index"), document.get("outputs")
    if isinstance(index, dict) and isinstance(outputs, dict) and is_packed(outputs.get(index.get("output"))):
        return packed_items(index["space"], tenant, document["_id"], outputs[index["output"]], at)
    found = embedding_from_document(document)
    if not found:
        return []
    return [Item(found[0], tenant, document["_id"], found[1], at)]


class IndexFollower:
    def __init__(
        self,
        redis: Redis,
        index: VectorIndex,
        store: ResultStore,
        *,
        shards: list[Shard],
        reader: Callable[[Shard], Awaitable[Redis]] | None = None,
        snapshot_interval_s: float,
        batch: int = 512,
        holds: Callable[[str], bool] | None = None,
        name: str = "",
        gap_check_s: float = GAP_CHECK_EVERY_S,
    ) -> None:
        """reader(shard): a client of one connection to the shard's Redis, for blocking
        reads (default: the main client). holds(tenant): whether this binder's index
        partition takes the tenant's vectors (default: every tenant's)."""
        self.redis = redis
        self.index = index
        self.store = store
        self.shards = shards
        self.reader = reader
        self.snapshot_interval_s = snapshot_interval_s
        self.batch = batch
        self.holds = holds or (lambda tenant: True)
        # Named, the follower says how far it has read each stream (Shard.results_readers):
        # the archiver trims no entry a live follower has not read.
        self.name = name
        self.gap_check_s = gap_check_s
        # When the positions were last reported (None: not since start), and whether the
        # reports were late at some time since the last gap check.
        self._reported_at: float | None = None
        self._reports_were_late = False  # at start, prepare() checked
        self.prepared = False
        self.caught_up = asyncio.Event()  # every stream read to its end once
        self.snapshotting: asyncio.Task[None] | None = None
        self._applied_since_snapshot = 0
        self._last_snapshot = time.monotonic()

    async def prepare(self) -> None:
        loaded = await asyncio.to_thread(self.index.load)
        gaps = [await self._gap_after(shard) for shard in self.shards] if loaded else []
        if loaded and not any(gaps):
            log.info(
                "index snapshot loaded at %s: %s",
                self.index.positions,
                {s: self.index.ntotal(s) for s in self.index.spaces},
            )
        else:
            await self.rebuild()
        self.prepared = True

    async def _gap_after(self, shard: Shard) -> bool:
        """True when entries after what the index applied may have been trimmed away."""
        last_id = self.index.position(shard.results)
        if not await self.redis.exists(shard.results):
            return False
        first = await self.redis.xrange(shard.results, count=1)
        return bool(first) and stream_id_order(first[0][0]) > stream_id_order(last_id) and last_id != "0-0"

    def _may_have_been_trimmed_past(self) -> bool:
        """Whether the archiver may have trimmed entries this follower had not read: it
        waits only for followers that report (named ones), while their reports are fresh."""
        now = time.monotonic()
        late = self._reported_at is None or now - self._reported_at > _REPORTS_LATE_S
        return not self.name or late or self._reports_were_late

    async def _gaps(self) -> bool:
        """The periodic gap check: True when a stream was trimmed past what was applied.
        (A trim up to the position also leaves the first entry past it: only a follower
        the archiver may have stopped waiting for is checked.)"""
        if not self._may_have_been_trimmed_past():
            return False
        found = [await self._gap_after(shard) for shard in self.shards]
        if self.name and self._reported_at is not None and time.monotonic() - self._reported_at <= _REPORTS_LATE_S:
            self._reports_were_late = False  # fresh again, and checked since
        return any(found)

    async def rebuild(self) -> None:
        """Everything MongoDB holds; run() then replays the streams from their start."""
        started = time.monotonic()
        items: list[Item] = []
        async for document in self.store.embeddings():
            try:
                found = item_from_document(document)
            except (ValueError, KeyError, TypeError) as exc:  # vectors that do not read: the rest still do
                log.warning("index rebuild: %s holds no readable vectors (%s)", document.get("_id"), exc)
                continue
            items.extend(item for item in found if self.holds(item.tenant))
        self.index.positions = {}
        added = await asyncio.to_thread(self.index.add, items)
        log.info("index rebuilt from MongoDB: %d vectors in %.1fs", added, time.monotonic() - started)

    async def run(self) -> None:
        if not self.prepared:  # at start, or after a failed start (MongoDB or Redis down)
            await self.prepare()
        housekeeping = asyncio.create_task(self._housekeeping())
        try:
            while True:
                caught_up: set[int] = set()
                followers = [asyncio.create_task(self._follow(shard, caught_up)) for shard in self.shards]
                try:
                    await self._until_a_gap([housekeeping, *followers])
                finally:
                    for task in followers:
                        task.cancel()
                    await asyncio.gather(*followers, return_exceptions=True)
                log.warning("index: a results stream was trimmed past what it applied; rebuilding from MongoDB")
                await self.rebuild()
        finally:
            housekeeping.cancel()
            await asyncio.gather(housekeeping, return_exceptions=True)

    async def _until_a_gap(self, tasks: list[asyncio.Task[None]]) -> None:
        """Return when the gap check finds a gap; raise what a task failed with (they
        run for good otherwise)."""
        while True:
            done, _ = await asyncio.wait(tasks, timeout=self.gap_check_s, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            if done:
                raise RuntimeError("an index follower task ended")
            if await self._gaps():
                return

    async def _follow(self, shard: Shard, caught_up: set[int]) -> None:
        reader = await self.reader(shard) if self.reader is not None else self.redis
        try:
            while True:
                stream = shard.results
                reply = await reader.xread({stream: self.index.position(stream)}, count=self.batch, block=1000)
                if not reply:
                    caught_up.add(shard.index)
                    if len(caught_up) == len(self.shards):
                        self.caught_up.set()
                    # Quiet (a read times out every second): what came last is snapshotted
                    # once the interval is up, not only when more comes.
                    self._maybe_snapshot()
                    continue
                entries = reply[0][1]
                items: list[Item] = []
                for _, fields in entries:
                    try:
                        found = item_of(ResultRecord.model_validate_json(fields.get("record", "")), self.store)
                    except (ValueError, TypeError):
                        continue  # not a record (or its vectors do not read); the storing side dead-letters it
                    items.extend(item for item in found if self.holds(item.tenant))
                self._applied_since_snapshot += await asyncio.to_thread(self.index.add, items, (stream, entries[-1][0]))
                self._maybe_snapshot()
        finally:
            if reader is not self.redis:
                await reader.aclose()

    async def _housekeeping(self) -> None:
        """Say how far every stream was read (every READ_POSITION_S); sweep expired vectors
        (every SWEEP_EVERY_S)."""
        last_sweep = time.monotonic()
        while True:
            await asyncio.sleep(READ_POSITION_S)
            if self.name:
                await self.report_positions()
            if time.monotonic() - last_sweep >= SWEEP_EVERY_S:
                last_sweep = time.monotonic()
                await asyncio.to_thread(self.index.forget_expired)

    async def report_positions(self) -> None:
        now_ms = int(time.time() * 1000)
        for shard in self.shards:
            await self.redis.hset(shard.results_readers, self.name, f"{self.index.position(shard.results)} {now_ms}")
        now = time.monotonic()
        if self._reported_at is not None and now - self._reported_at > _REPORTS_LATE_S:
            self._reports_were_late = True
        self._reported_at = now

    def _maybe_snapshot(self) -> None:
        """Start a snapshot in the background when one is due and none is being written."""
        now = time.monotonic()
        idle = self.snapshotting is None or self.snapshotting.done()
        if self._applied_since_snapshot and idle and now - self._last_snapshot >= self.snapshot_interval_s:
            self.snapshotting = asyncio.create_task(self._snapshot())
            self._last_snapshot, self._applied_since_snapshot = now, 0

    async def _snapshot(self) -> None:
        try:
            await asyncio.to_thread(self.index.snapshot)
        except Exception as exc:  # the next one tries again; CURRENT still names the last good one
            log.warning("index snapshot failed: %s", exc)

    async def close(self) -> None:
        """Wait for a snapshot in progress, then take a last one (only of an index that
        was loaded or rebuilt: an empty one must not replace a good snapshot)."""
        if self.snapshotting is not None:
            await asyncio.gather(self.snapshotting, return_exceptions=True)
        if self.prepared:
            await asyncio.to_thread(self.index.snapshot)
