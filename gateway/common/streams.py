"""The Redis-stream consumer core shared by the dispatcher (request queues) and the
binder (results): one member of a consumer group.

- read: new entries of several streams in one bounded XREADGROUP (a count per stream);
- heartbeat: XCLAIM entries to ourselves, resetting their idle time, so nobody takes
  work we are still doing;
- reclaim: XAUTOCLAIM entries idle past claim_idle_ms (their consumer died), walking
  each stream's whole pending list with the cursor carried forward between calls;
  an entry delivered more than max_deliveries times goes to the dead-letter stream
  with its error instead of being handed out again; an entry trimmed away is acked;
- dead letters: each names its entry (and the entry's `id` field) with the error, and
  holds the entry's fields only where they can be replayed; the stream keeps them
  dead_letter_keep_s (and at most DEAD_LETTERS_KEPT), so what callers can trigger cannot
  fill Redis;
- trim: drop only entries the group has delivered and acknowledged.

Correctness does not rest on who holds an entry: the work an entry stands for is fenced
elsewhere (request attempts, unique MongoDB ids); the pending list only tells which
work has lost its worker."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.exceptions import ResponseError

log = logging.getLogger(__name__)

# Dead letters a stream keeps at most, whatever their age (the newest).
DEAD_LETTERS_KEPT = 10_000


@dataclass(frozen=True)
class Entry:
    stream: str
    id: str
    fields: dict[str, str]
    deliveries: int = 1


def stream_id_order(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


def next_id(entry_id: str) -> str:
    """The smallest entry id after this one."""
    millis, seq = stream_id_order(entry_id)
    return f"{millis}-{seq + 1}"


@dataclass
class StreamConsumer:
    redis: Redis
    group: str
    consumer: str
    dead_letters: str
    claim_idle_ms: int
    max_deliveries: int
    # Says why an entry keeps failing, for its dead letter (default: it was never acked).
    explain: Callable[[Entry], str] | None = None
    # Called after an entry is parked as a dead letter (what else it leaves behind).
    on_dead_letter: Callable[[Entry], Awaitable[None]] | None = None
    # How long a dead letter is kept (time to inspect and replay it).
    dead_letter_keep_s: int = 24 * 3600
    # Where each stream's XAUTOCLAIM walk has got to.
    _cursors: dict[str, str] = field(default_factory=dict)
    _groups: set[str] = field(default_factory=set)

    async def ensure_group(self, stream: str, start: str = "0") -> None:
        if stream in self._groups:
            return
        try:
            await self.redis.xgroup_create(stream, self.group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(stream)

    async def read(self, counts: dict[str, int], *, block_ms: int | None, reader: Redis | None = None) -> list[Entry]:
        """Up to counts[stream] new entries of each stream, in one call. XREADGROUP's
        COUNT applies per stream, so streams that want different counts are read in
        groups of equal count; only the first group blocks."""
        by_count: dict[int, list[str]] = {}
        for stream, count in counts.items():
            if count > 0:
                by_count.setdefault(count, []).append(stream)
        entries: list[Entry] = []
        for position, (count, streams) in enumerate(sorted(by_count.items(), reverse=True)):
            block = block_ms if position == 0 and not entries else None
            reply = await (reader or self.redis).xreadgroup(
                self.group, self.consumer, {s: ">" for s in streams}, count=count, block=block
            )
            for stream, items in reply or []:
                entries.extend(Entry(stream, entry_id, fields or {}) for entry_id, fields in items)
        return entries

    async def read_own_pending(self, stream: str, count: int) -> list[Entry]:
        """Entries delivered to this consumer name and not acknowledged (after a restart)."""
        reply = await self.redis.xreadgroup(self.group, self.consumer, {stream: "0"}, count=count)
        return [Entry(stream, entry_id, fields or {}) for _, items in reply or [] for entry_id, fields in items]

    async def heartbeat(self, held: dict[str, list[str]]) -> None:
        """Reset the idle time of entries we still work on."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for stream, ids in held.items():
                if ids:
                    pipe.xclaim(stream, self.group, self.consumer, 0, ids, justid=True)
            await pipe.execute()

    async def ack(self, stream: str, *ids: str) -> None:
        if ids:
            await self.redis.xack(stream, self.group, *ids)

    async def reclaim(self, stream: str, count: int) -> list[Entry]:
        """Up to `count` entries idle past claim_idle_ms, taken over by this consumer.
        Entries delivered too often are dead-lettered, not returned."""
        start = self._cursors.get(stream, "0-0")
        reply = await self.redis.xautoclaim(stream, self.group, self.consumer, self.claim_idle_ms, start, count=count)
        next_start, claimed = reply[0], reply[1]
        deleted = reply[2] if len(reply) > 2 else []
        self._cursors[stream] = next_start  # "0-0" when the walk went round
        if deleted:  # trimmed away while pending: nothing left to do for them
            await self.ack(stream, *deleted)
        live = [(entry_id, fields) for entry_id, fields in claimed if fields]
        if len(live) < len(claimed):
            await self.ack(stream, *(entry_id for entry_id, fields in claimed if not fields))
        if not live:
            return []
        deliveries = await self._deliveries(stream, [entry_id for entry_id, _ in live])
        entries = []
        for entry_id, fields in live:
            entry = Entry(stream, entry_id, fields, deliveries.get(entry_id, 1))
            if entry.deliveries > self.max_deliveries:
                why = self.explain(entry) if self.explain else "never acknowledged"
                await self.dead_letter(entry, f"{why} (delivered {entry.deliveries} times)")
            else:
                entries.append(entry)
        return entries

    async def _deliveries(self, stream: str, ids: list[str]) -> dict[str, int]:
        ordered = sorted(ids, key=stream_id_order)
        details = await self.redis.xpending_range(
            stream, self.group, min=ordered[0], max=ordered[-1], count=len(ids) * 4 + 16, consumername=self.consumer
        )
        return {d["message_id"]: int(d["times_delivered"]) for d in details}

    async def dead_letter(self, entry: Entry, error: str, *, replayable: bool = True) -> None:
        """Park a poison entry, with its error, where an operator can inspect it: whole
        where it can be replayed, else by reference (its stream, entry id and `id` field),
        and for dead_letter_keep_s. A replayable one's on_dead_letter is called after (an
        entry parked by reference leaves what it left behind to its caller)."""
        now = time.time()
        parked: dict[str, str | int | float] = {
            "stream": entry.stream,
            "entry": entry.id,
            "id": entry.fields.get("id", ""),
            "error": error[:2000],
            "deliveries": entry.deliveries,
            "at": now,
        }
        if replayable:
            parked["fields"] = json.dumps(entry.fields)
        async with self.redis.pipeline(transaction=True) as pipe:
            # MINID keeps what is younger than dead_letter_keep_s, the count bounds the rest,
            # and the stream itself goes dead_letter_keep_s after its last dead letter.
            pipe.xadd(
                self.dead_letters, parked, minid=f"{int((now - self.dead_letter_keep_s) * 1000)}-0", approximate=False
            )
            pipe.xtrim(self.dead_letters, maxlen=DEAD_LETTERS_KEPT, approximate=True)
            pipe.expire(self.dead_letters, self.dead_letter_keep_s)
            pipe.xack(entry.stream, self.group, entry.id)
            await pipe.execute()
        log.error("entry %s of %s dead-lettered: %s", entry.id, entry.stream, error)
        if replayable and self.on_dead_letter is not None:
            await self.on_dead_letter(entry)

    async def trim(self, stream: str, keep_newer_than_s: float = 0, read_up_to: str | None = None) -> None:
        """Drop only entries the group has delivered and acknowledged: up to its last
        delivered one and before its oldest pending one (and older than the window, and up
        to `read_up_to`, where other readers are). Exact, not in whole stream nodes: a
        quiet shard's last entries go too."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError:  # the stream is gone
            return
        info = next((g for g in groups if g["name"] == self.group), None)
        if info is None:
            return
        bounds = [next_id(info["last-delivered-id"])]  # MINID keeps ids >= the bound
        pending = await self.redis.xpending(stream, self.group)
        if pending["pending"]:
            bounds.append(pending["min"])
        if keep_newer_than_s:
            bounds.append(f"{int((time.time() - keep_newer_than_s) * 1000)}-0")
        if read_up_to is not None:
            bounds.append(next_id(read_up_to))
        await self.redis.xtrim(stream, minid=min(bounds, key=stream_id_order), approximate=False)
