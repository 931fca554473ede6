"""The archiver: reads every shard's `results` stream as a member of the binders'
consumer group (the shared consumer core, gateway.common.streams), in batches, writes
one MongoDB document per request, and acknowledges an entry only after MongoDB
acknowledged its write. Stored results get their webhooks queued.

Recovery needs no lock: entries left pending by a dead binder are reclaimed once idle;
an entry delivered too often goes to the dead-letter stream with its error (and can be
replayed from there); trimming drops only acknowledged entries. A result MongoDB can never
take (BSON cannot encode it, it is over the document size limit, or MongoDB refused the
document) ends as failed instead: its record, as `result_unstorable` without its inputs,
parameters and outputs (ResultStore.unstorable_record), goes on the results stream in its
place (stored, polled and sent to its webhook as any other), and the dead-letter stream
names it with its reason (by reference: what cannot be stored is not kept). The rest of
its batch is stored, and the entries after it too. Dead letters are kept LIVE_STATE_TTL_S.

MongoDB out of reach, or failing the whole call for any other reason (a primary stepping
down, a timeout), is an outage, not a bad entry: the run fails (the supervisor backs off
and /healthz says so) instead of handing the batch to reclaim, which would count
deliveries against the entries and dead-letter good results."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any

from redis.asyncio import Redis

from binder.settings import BinderSettings
from binder.webhooks import WebhookQueue
from gateway.common import tracing
from gateway.common.logs import request_ids_bound
from gateway.common.redis import REDIS_OUTAGE
from gateway.common.result_store import ResultStore, Unstorable
from gateway.common.retry import raise_if_cancelled
from gateway.common.streams import Entry, StreamConsumer, stream_id_order
from gateway.protocol import ResultRecord, valid_request_id
from gateway.protocol.redis_keys import BINDER_GROUP, Shard, all_shards, shard_of

log = logging.getLogger(__name__)

# Mark the live state as stored (never re-creating a request hash that has expired) and
# let it go RESULTS_KEEP_S later (meanwhile polls read Redis's copy as stored: the
# gateway's results/reader.py): from then on every read is answered from MongoDB (a
# result, an SSE replay of the final record), so a finished request leaves nothing of its
# own in Redis. FINISH gives the live state no expiry (the binder gives it one here, or
# LIVE_STATE_TTL_S when the result is dead-lettered). KEYS: each request's hash then its
# events stream; ARGV[1]: seconds. Three commands a request: the hash's EXPIRE says whether
# it still exists.
MARK_STORED = """
local keep = tonumber(ARGV[1])
for i = 1, #KEYS, 2 do
  if redis.call('EXPIRE', KEYS[i], keep) == 1 then
    redis.call('HSET', KEYS[i], 'stored', '1')
    redis.call('EXPIRE', KEYS[i + 1], keep)
  end
end
return 1
"""

# A result MongoDB can never store ends as failed: its failed record (ARGV[2]) goes on the
# results stream (KEYS[1]) in its place, and the request's hash (KEYS[2]; never re-created
# once it has expired) names it, so that polls read it from now on. ARGV[1]: the request id.
FAIL_UNSTORABLE = """
local entry = redis.call('XADD', KEYS[1], '*', 'id', ARGV[1], 'record', ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('HSET', KEYS[2], 'state', 'failed', 'result', entry)
end
return entry
"""

# Trimming: a results entry goes once it is stored (the group acknowledged it), every live
# index follower has read it (Shard.results_readers: followers seen within READER_LIVE_S),
# and RESULTS_KEEP_S has passed; a follower gone longer rebuilds from MongoDB when back
# (its gap check: at start and every GAP_CHECK_EVERY_S, binder/index/follower.py).
TRIM_EVERY_S = 5.0
READER_LIVE_S = 60.0


# A shard's loop waits this long, doubling up to the most, for its Redis to come back.
SHARD_RETRY_FIRST_S = 0.1
SHARD_RETRY_MAX_S = 2.0
# A turn of a shard's loop (a read, storing what it read, acknowledging it) that takes
# longer than this is taken for stuck and started again: in a failover test a shard's
# loop once stopped storing for good, with nothing logged (docs/deployment.md). Far above
# any turn's own limits (Redis's and MongoDB's timeouts, the read's block).
TURN_LIMIT_S = 60.0


class StoreUnavailable(Exception):
    """MongoDB could not be reached; the batch stays pending for the next run."""


class Archiver:
    def __init__(self, redis: Redis, store: ResultStore, webhooks: WebhookQueue, settings: BinderSettings) -> None:
        self.redis = redis
        self.store = store
        self.webhooks = webhooks
        self.settings = settings
        self.shards = all_shards(settings.redis_shards)
        self.consumers = {
            shard.index: StreamConsumer(
                redis,
                BINDER_GROUP,
                settings.binder_name,
                shard.results_dead,
                claim_idle_ms=settings.claim_idle_ms,
                max_deliveries=settings.max_deliveries,
                explain=self._explain,
                on_dead_letter=self._let_live_state_go,
                dead_letter_keep_s=settings.live_state_ttl_s,
            )
            for shard in self.shards
        }
        self._mark_stored = redis.register_script(MARK_STORED)
        self._fail_unstorable = redis.register_script(FAIL_UNSTORABLE)
        self.stored_total = 0
        # Entries this binder dead-lettered, by reason: "unencodable", "too_large" and
        # "refused" (at once), "redelivered" (delivered max_deliveries times without being stored).
        self.dead_lettered: dict[str, int] = {}
        self.prepared = False
        tracing.setup("triton-gateway-binder")  # nothing when not configured

    async def prepare(self) -> None:
        """MongoDB's indexes and the consumer groups (in run(), so a binder started while
        MongoDB or Redis is down comes up, says so on /healthz, and goes on once they return)."""
        await self.store.prepare()
        for shard in self.shards:
            await self.consumers[shard.index].ensure_group(shard.results)
        self.prepared = True

    async def run(self) -> None:
        """Store results for good (returns only by failing; the caller restarts it)."""
        if not self.prepared:
            await self.prepare()
        # A task group: a loop failing (MongoDB away, a defect) stops the others before run()
        # returns, so the restart that follows does not leave them running beside their
        # successors. One shard's Redis away fails nothing: that loop waits for it alone.
        try:
            async with asyncio.TaskGroup() as group:
                for shard in self.shards:
                    group.create_task(self._run_shard(shard), name=f"archiver {shard.results}")
        except ExceptionGroup as failed:
            raise failed.exceptions[0] from None  # what failed, for the health report and the log

    async def _run_shard(self, shard: Shard) -> None:
        """Store the shard's results for good; while its Redis is away (a failover), wait
        for it with backoff: the other shards go on storing."""
        delay = SHARD_RETRY_FIRST_S
        while True:
            raise_if_cancelled()
            try:
                await self._serve_shard(shard)
            except REDIS_OUTAGE as exc:  # (a turn past TURN_LIMIT_S too: TimeoutError is an OSError)
                log.warning("results of %s wait for their Redis (%s: %s)", shard.results, type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(SHARD_RETRY_MAX_S, delay * 2)

    async def _serve_shard(self, shard: Shard) -> None:
        consumer = self.consumers[shard.index]
        stream = shard.results
        async with asyncio.timeout(TURN_LIMIT_S):
            await self._drain_own_pending(consumer, stream)
        last_reclaim = last_trim = time.monotonic()
        while True:
            # The task group cancels every shard's loop when one fails: a loop that went on
            # after a cancellation its Redis call swallowed would hold the group for good.
            raise_if_cancelled()
            async with asyncio.timeout(TURN_LIMIT_S):
                last_reclaim, last_trim = await self._serve_turn(shard, consumer, last_reclaim, last_trim)

    async def _serve_turn(
        self, shard: Shard, consumer: StreamConsumer, last_reclaim: float, last_trim: float
    ) -> tuple[float, float]:
        """Read the shard's new results, store and acknowledge them; reclaim and trim when
        due. Returns when reclaiming and trimming were last done."""
        stream = shard.results
        batch = self.settings.batch_size
        entries = await consumer.read({stream: batch}, block_ms=self.settings.block_ms)
        if entries and len(entries) < batch and self.settings.linger_ms:
            await asyncio.sleep(self.settings.linger_ms / 1000)
            entries += await consumer.read({stream: batch - len(entries)}, block_ms=None)
        if entries:
            await self.process(entries, consumer)
        now = time.monotonic()
        if now - last_reclaim >= self.settings.claim_idle_ms / 2000:
            last_reclaim = now
            reclaimed = await consumer.reclaim(stream, batch)
            if reclaimed:
                log.info("reclaimed %d result entries of %s", len(reclaimed), stream)
                await self.process(reclaimed, consumer)
        if now - last_trim >= TRIM_EVERY_S:
            last_trim = now
            await consumer.trim(
                stream, keep_newer_than_s=self.settings.results_keep_s, read_up_to=await self._readers_at(shard)
            )
        return last_reclaim, last_trim

    async def _readers_at(self, shard: Shard) -> str | None:
        """The entry the slowest live index follower has read up to (None: no follower said)."""
        now_ms = time.time() * 1000
        positions = []
        for value in (await self.redis.hgetall(shard.results_readers)).values():
            position, _, seen_ms = value.partition(" ")
            if seen_ms and now_ms - float(seen_ms) < READER_LIVE_S * 1000:
                positions.append(position)
        return min(positions, key=stream_id_order) if positions else None

    async def _drain_own_pending(self, consumer: StreamConsumer, stream: str) -> None:
        """After a restart under the same name: what we had read but not acknowledged."""
        while entries := await consumer.read_own_pending(stream, self.settings.batch_size):
            if not await self.process(entries, consumer):
                return  # what is left keeps failing; reclaim counts its deliveries

    async def process(self, entries: list[Entry], consumer: StreamConsumer | None = None) -> int:
        """Store a batch of one shard's entries; returns how many were acknowledged."""
        if not entries:
            return 0
        started = tracing.clock()
        stream = entries[0].stream
        consumer = consumer or self._consumer_of(stream)
        records: dict[str, ResultRecord] = {}
        entry_of: dict[str, list[Entry]] = {}
        for entry in entries:
            try:
                record = ResultRecord.model_validate_json(entry.fields.get("record") or "")
            except ValueError:
                log.warning("entry %s is not a result record; it will be dead-lettered after retries", entry.id)
                continue
            records[record.request_id] = record  # the same request twice in a batch: once
            entry_of.setdefault(record.request_id, []).append(entry)
        if not records:
            return 0
        outcome = await self.store.insert(list(records.values()))
        if outcome.unavailable:
            raise StoreUnavailable(next(iter(outcome.failed.values())))
        dead = 0
        for request_id, (kind, why) in outcome.refused.items():
            with request_ids_bound(trace_id=records[request_id].trace_id, request_id=request_id):
                await self._fail_in_place(records[request_id], kind, why)
                for entry in entry_of[request_id]:
                    await consumer.dead_letter(
                        entry, f"MongoDB cannot store this result ({kind}): {why}", replayable=False
                    )
                    self._count_dead_letter(kind)
                    dead += 1
        for request_id, error in outcome.failed.items():
            with request_ids_bound(trace_id=records[request_id].trace_id, request_id=request_id):
                log.warning("storing %s failed: %s", request_id, error)
        if log.isEnabledFor(logging.DEBUG):  # a line per result: too many for INFO
            for request_id in outcome.stored:
                with request_ids_bound(trace_id=records[request_id].trace_id, request_id=request_id):
                    log.debug("stored %s (%s)", request_id, records[request_id].status.value)
        if not outcome.stored:
            return dead
        # One call per shard: a script's keys must share a slot on Redis Cluster.
        by_shard: dict[Shard, list[str]] = {}
        for rid in outcome.stored:
            by_shard.setdefault(shard_of(rid), []).append(rid)
        for shard, ids in by_shard.items():
            keys = [key for rid in ids for key in (shard.request(rid), shard.events(rid))]
            await self._mark_stored(keys=keys, args=[max(1, math.ceil(self.settings.results_keep_s))])
        await self.webhooks.enqueue([records[rid] for rid in outcome.stored])
        acked = [entry.id for rid in outcome.stored for entry in entry_of[rid]]
        await consumer.ack(stream, *acked)
        # A span in each stored result's trace, from reading the batch to acknowledging it.
        tracing.consumed("binder.store", (records[rid].traceparent for rid in outcome.stored), started)
        self.stored_total += len(outcome.stored)
        return dead + len(acked)

    async def _fail_in_place(self, record: ResultRecord, kind: str, why: str) -> None:
        """The request ends as failed: its failed record on the results stream in place of
        the one MongoDB cannot take (stored as any other later), named by its hash. Written
        before the entry is dead-lettered: a crash between the two writes it again, which
        storing and webhooks take as the same record."""
        shard = shard_of(record.request_id)
        try:
            failed = self.store.unstorable_record(record, kind, why)
        except Unstorable as exc:  # not even that: the live state is left to expire
            log.error("not even the failed record of %s can be stored: %s", record.request_id, exc.why)
            await self._let_live_state_go(Entry(shard.results, "0-0", {"id": record.request_id}))
            return
        await self._fail_unstorable(
            keys=[shard.results, shard.request(record.request_id)], args=[record.request_id, failed.model_dump_json()]
        )

    def _count_dead_letter(self, reason: str) -> None:
        self.dead_lettered[reason] = self.dead_lettered.get(reason, 0) + 1

    async def _let_live_state_go(self, entry: Entry) -> None:
        """A result that could not be stored keeps its live state (FINISH gives it no
        expiry) LIVE_STATE_TTL_S more: long enough to replay the dead letter."""
        request_id = entry.fields.get("id", "")
        if not valid_request_id(request_id):
            return
        shard = shard_of(request_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.expire(shard.request(request_id), self.settings.live_state_ttl_s)
            pipe.expire(shard.events(request_id), self.settings.live_state_ttl_s)
            await pipe.execute()

    def _explain(self, entry: Entry) -> str:
        """Why an entry delivered too often failed (called as it is dead-lettered)."""
        self._count_dead_letter("redelivered")
        try:
            ResultRecord.model_validate_json(entry.fields.get("record") or "")
        except ValueError as exc:
            return f"not a result record: {str(exc).splitlines()[0]}"
        return "storing failed repeatedly"

    def _consumer_of(self, stream: str) -> StreamConsumer:
        for shard in self.shards:
            if shard.results == stream:
                return self.consumers[shard.index]
        raise ValueError(f"{stream} is not a results stream")

    async def dead_letters(self, limit: int = 100) -> list[dict[str, Any]]:
        """The oldest dead-lettered results of each shard, with why each was parked."""
        found = []
        for shard in self.shards:
            for entry_id, fields in await self.redis.xrange(shard.results_dead, count=limit):
                request_id = fields.get("id") or None
                if request_id is None:  # (parked before dead letters named it)
                    try:
                        request_id = json.loads(fields.get("fields") or "{}").get("id")
                    except ValueError:
                        request_id = None
                found.append(
                    {
                        "id": entry_id,
                        "stream": fields.get("stream"),
                        "entry": fields.get("entry"),
                        "request_id": request_id,
                        "error": fields.get("error"),
                        "deliveries": int(fields.get("deliveries") or 0),
                        "at": float(fields.get("at") or 0),
                        "replayable": "fields" in fields,
                    }
                )
        return found

    async def replay_dead_letters(self, limit: int = 1000) -> int:
        """Put dead-lettered results back on their results streams (after the cause, say a
        MongoDB problem, is fixed). Returns how many were requeued. Those parked by
        reference (never storable: their requests ended as failed) stay until they expire."""
        requeued = 0
        for shard in self.shards:
            entries = await self.redis.xrange(shard.results_dead, count=limit)
            for entry_id, fields in entries:
                if "fields" not in fields:
                    continue
                original = json.loads(fields["fields"] or "{}")
                if original.get("record"):
                    await self.redis.xadd(shard.results, original)
                    requeued += 1
                await self.redis.xdel(shard.results_dead, entry_id)
        return requeued
