"""Server-Sent Events from the requests' event streams, with one Redis reader per shard
and process, so a thousand SSE clients cost one connection per shard. A new client's
stream is read at once: a reader blocked on the notices is woken by the notice FOLLOW
writes for it; otherwise the new client interrupts the blocked read (CLIENT UNBLOCK).

How the reader waits depends on how many streams of the shard it follows:
- up to NAMED_MOST, a single XREAD BLOCK names them all and returns with whatever was
  written to any of them (one round trip an event);
- past it, such a call would cost Redis and this process in proportion to the streams
  named, every time one of them is written (~700 µs of Redis a call at 200 streams, and
  ~1.3 ms of this loop's time packing a call at 1,000: docs/benchmarks.md). So the reader
  blocks on the shard's notices instead (the scripts that write a followed request's
  events name it there, once a call: queue/scripts/runs.py, FOLLOW), then reads the streams
  named. Where each stream is read from stays the reader's own, so a notice lost (trimmed
  while the reader lagged, or by a failover) delays events and loses none: every stream is
  read anyway every FULL_READ_EVERY_S.

A request's `output` and terminal events do not hold its record: they name its entry in
the results stream (where FINISH wrote it once). The hub puts the record back (the whole
record for the terminal event, its outputs for `output`), once per entry for all the
entry's followers, so clients read the same events as if they held it.

An entry may hold two events, to save Redis a write: a request started at once has its
`queued` event in its `running` entry, and a request's `output` event rides on its
terminal entry. The entry's own event has the entry's id; the one before it `<id>-0`,
which sorts before it (event_order), so Last-Event-ID resumes between them."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.common.streams import stream_id_order
from gateway.protocol import EventKind
from gateway.protocol.redis_keys import Shard, shard_of
from gateway.server.errors import Refused
from gateway.server.tenants.shares import PoolFull, SharedPool

log = logging.getLogger(__name__)

TERMINAL_KINDS = {kind.value for kind in EventKind if kind.terminal}
BLOCK_MS = 1000
# Entries read from a stream in one call (more wait for the next).
COUNT = 512
# Up to this many followed streams in a shard, one blocking XREAD names them all; past it,
# the reader waits on the shard's notices (the module docstring). A burst of 32 stream starts
# stays named: by notices each of its followers costs a FOLLOW before its stream is read and
# each event a second read (a burst settled in 5-6 ms, not 2-3; 3.5-4.6 Redis commands a
# follower, not 0.2), while named reads of 32 streams cost an event what notices do
# (bench.event_hub --streams 32,64 --ways "named,by notices": at 64 named costs ~10 µs more).
NAMED_MOST = 32
# Reading by notices, every followed stream is read this often all the same.
FULL_READ_EVERY_S = 2.0
# A followed stream is checked for existence this often (it may have expired).
EXISTS_EVERY_S = 30.0


# The whole pool of followers is held (503 too_many_streams).
TooManyStreams = PoolFull


# The largest part of a stream id (ms-seq: unsigned 64-bit numbers).
MAX_ID_PART = (1 << 64) - 1
# An entry's own event sorts after the event it carries before it (`<id>-0`).
_OWN = MAX_ID_PART + 1


def event_order(event_id: str) -> tuple[int, int, int]:
    """Where an event id ("ms-seq" of its entry, or "ms-seq-0" for the event an entry holds
    before its own) sorts."""
    millis, _, rest = event_id.partition("-")
    seq, _, sub = rest.partition("-")
    return int(millis), int(seq or 0), int(sub) if sub else _OWN


def read_after(event_id: str) -> str:
    """The stream id to read after for the events after event_id: its entry's id, or for
    the event an entry holds before its own, the id just before the entry."""
    millis, seq, sub = event_order(event_id)
    if sub == _OWN:
        return f"{millis}-{seq}"
    if seq > 0:
        return f"{millis}-{seq - 1}"
    return f"{millis - 1}-{MAX_ID_PART}" if millis > 0 else "0-0"


@dataclass(frozen=True)
class StreamEvent:
    id: str
    kind: str
    data: str

    @property
    def terminal(self) -> bool:
        return self.kind in TERMINAL_KINDS


@dataclass(eq=False)
class _Follower:
    key: str
    after: str
    # The index of the next token piece it expects (None: any, it joined mid-stream). A
    # token event it has the pieces of already (written again after Redis lost them) is
    # skipped.
    next_piece: int | None = None
    queue: asyncio.Queue[StreamEvent | None] = field(default_factory=asyncio.Queue)


@dataclass(eq=False)
class _ShardReader:
    """The followers of one shard's streams and the task that reads them."""

    shard: Shard
    followers: dict[str, set[_Follower]] = field(default_factory=dict)
    # Per followed stream, where the next XREAD starts: the last entry fanned out, or an
    # earlier one a new follower needs.
    positions: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    connection: Redis | None = None
    connection_id: int | None = None
    task: asyncio.Task[None] | None = None
    health: LoopHealth | None = None
    # Reading by notices: the last notice read (None: read every stream first), when every
    # stream was last read, and the streams to read next whatever the notices say: those
    # followed since the last read, and those whose last read stopped at COUNT.
    notices_after: str | None = None
    full_read_at: float = 0.0
    fresh: set[str] = field(default_factory=set)
    again: set[str] = field(default_factory=set)
    # The streams whose requests are marked followed (or being marked) since the reader's
    # connection last ended: a failover may have lost the marks made before.
    marked: set[str] = field(default_factory=set)


class EventHub:
    def __init__(
        self,
        redis: Redis,
        connect_reader: Callable[[Shard], Awaitable[Redis]],
        records: Callable[[str, str], Awaitable[str]],
        mark_followed: Callable[[str, bool], Awaitable[bool]],
        *,
        max_followers: int = 10_000,
        tenant_share: int | None = None,
        named_most: int = NAMED_MOST,
        full_read_every_s: float = FULL_READ_EVERY_S,
    ) -> None:
        """connect_reader(shard) gives a client of one connection to the Redis that holds
        the shard, for blocking reads (its id can be unblocked); records(request id,
        results entry) gives a record (from Redis, or MongoDB once stored);
        mark_followed(request id, notice) has the scripts name the request in its shard's
        notices, and with notice names it there now; False if the request is gone
        (JobStore.follow). max_followers: the followers and long polls this process holds at
        once; tenant_share: how many of them one tenant may hold (None: all)."""
        self.redis = redis  # for checks
        self.connect_reader = connect_reader
        self.records = records
        self.mark_followed = mark_followed
        self.max_followers = max_followers
        # Followers (SSE streams, /v1 streams) and long polls, by tenant.
        self.pool = SharedPool(
            "event streams and long polls",
            total=max_followers,
            share=tenant_share or max_followers,
            full_code="too_many_streams",
        )
        self.named_most = named_most
        self.full_read_every_s = full_read_every_s
        # Long polls waiting now: the edge's overload shed leaves them out of its count,
        # as this pool bounds them (and by tenant), so no tenant's long polls shed others.
        self.long_polls = 0
        self._readers: dict[int, _ShardReader] = {}
        self._closed = False

    async def start(self) -> None:
        """Readers start with their first follower."""

    async def close(self) -> None:
        self._closed = True
        await cancel_and_wait(r.task for r in self._readers.values() if r.task)
        for reader in self._readers.values():
            for followers in reader.followers.values():
                for follower in followers:
                    follower.queue.put_nowait(None)

    @property
    def health(self) -> list[LoopHealth]:
        return [r.health for r in self._readers.values() if r.health is not None]

    @property
    def followers(self) -> int:
        return sum(len(f) for r in self._readers.values() for f in r.followers.values())

    def admissible(self, tenant: str | None) -> None:
        """Raise the refusal a follower or long poll of this tenant would get now
        (ShareExceeded, TooManyStreams): for a route to answer it before its response starts."""
        self.pool.check(tenant)

    def room_for(self, tenant: str | None) -> bool:
        """Whether a follower or long poll of this tenant would be held now."""
        try:
            self.pool.check(tenant)
        except Refused:
            return False
        return True

    @contextmanager
    def holding(self, tenant: str | None) -> Iterator[None]:
        """Hold a place of the pool for a long poll (refused at once when there is none)."""
        with self.pool.hold(tenant):
            self.long_polls += 1
            try:
                yield
            finally:
                self.long_polls -= 1

    async def follow(self, request_id: str, after: str, *, tenant: str | None) -> AsyncIterator[StreamEvent]:
        """The events of a request after `after`, up to and including the terminal one.
        Ends early (returns) if the stream disappears. Counted against the share of
        `tenant`, the tenant of the call it serves (None: the total only) (ShareExceeded,
        TooManyStreams before the first event)."""
        async for event in self.follow_idle(request_id, after, idle_s=None, tenant=tenant):
            if event is not None:
                yield event

    async def follow_idle(
        self, request_id: str, after: str, *, idle_s: float | None, tenant: str | None
    ) -> AsyncIterator[StreamEvent | None]:
        """As follow(), and, until the request has started, None whenever nothing came for
        idle_s (for the caller to say something meanwhile). Every door's followers (native
        SSE, /v1, Anthropic, WebSocket) name their caller's tenant: one share for them all."""
        # Refused here, before the first event, when the tenant holds its share.
        with self.pool.hold(tenant):
            shard = shard_of(request_id)
            reader = self._reader(shard)
            follower = _Follower(shard.events(request_id), after, 0 if after == "0-0" else None)
            reader.followers.setdefault(follower.key, set()).add(follower)
            position, start = reader.positions.get(follower.key), read_after(after)
            if position is None or stream_id_order(start) < stream_id_order(position):
                reader.positions[follower.key] = start
            try:
                if len(reader.positions) > self.named_most:  # read by notices (below it, no need)
                    # Marked before its stream is read: what is written before the mark, that
                    # read finds; what after, a notice names (the reader follows it already).
                    # A reader blocked on the notices is woken by the mark's own notice.
                    by_notices = reader.notices_after is not None
                    noticed = await self._mark(reader, follower.key, notice=by_notices)
                    reader.fresh.add(follower.key)
                    if not (noticed and by_notices):
                        await self._interrupt(reader)
                else:
                    await self._interrupt(reader)
                waiting = idle_s is not None
                while True:
                    if waiting:
                        try:
                            async with asyncio.timeout(idle_s):
                                event = await follower.queue.get()
                        except TimeoutError:
                            yield None
                            continue
                    else:
                        event = await follower.queue.get()
                    if event is None:
                        return
                    waiting = waiting and event.kind == "queued"
                    yield event
                    if event.terminal:
                        return
            finally:
                followers = reader.followers.get(follower.key)
                if followers is not None:
                    followers.discard(follower)
                    if not followers:
                        del reader.followers[follower.key]
                        reader.positions.pop(follower.key, None)
                        reader.fresh.discard(follower.key)
                        reader.again.discard(follower.key)
                        reader.marked.discard(follower.key)

    def _reader(self, shard: Shard) -> _ShardReader:
        reader = self._readers.get(shard.index)
        if reader is None:
            reader = self._readers[shard.index] = _ShardReader(shard)
        if reader.task is None and not self._closed:
            reader.health = LoopHealth(f"event reader {shard.prefix}")
            reader.task = asyncio.create_task(supervise(reader.health, lambda: self._run(reader)), name="event-hub")
        return reader

    async def _interrupt(self, reader: _ShardReader) -> None:
        """Make the blocked XREAD return so the next one includes the new stream: once for
        the followers that come before the reader begins its next read, which includes
        them all (a burst of SSE clients costs one round trip, not one each)."""
        if reader.changed.is_set():
            return
        reader.changed.set()
        if reader.connection_id is not None:
            try:
                await self.redis.client_unblock(reader.connection_id)
            except Exception as exc:  # the reader is reconnecting; it reads all streams when back
                log.debug("unblocking the event reader failed: %s", exc)

    async def _run(self, reader: _ShardReader) -> None:
        loop = asyncio.get_running_loop()
        last_exists_check = loop.time()
        connection = reader.connection = await self.connect_reader(reader.shard)
        try:
            reader.connection_id = await connection.client_id()
            reader.notices_after = None  # (re)connected: every stream is read first
            while True:
                if not reader.followers:
                    reader.changed.clear()
                    await reader.changed.wait()
                    continue
                reader.changed.clear()
                if len(reader.positions) <= self.named_most:
                    reader.notices_after = None
                    reader.fresh.clear()  # (this read names them all)
                    read_from = dict(reader.positions)
                    reply = await connection.xread(read_from, count=COUNT, block=BLOCK_MS)
                    await self._deliver(reader, reply, read_from)
                else:
                    await self._read_noticed(reader, connection)
                if loop.time() - last_exists_check > EXISTS_EVERY_S:
                    last_exists_check = loop.time()
                    await self._end_vanished(reader)
        finally:
            reader.connection_id = None
            reader.connection = None
            reader.marked.clear()  # a failover may have lost them: marked again when back
            await connection.aclose()

    async def _mark(self, reader: _ShardReader, key: str, *, notice: bool = False) -> bool:
        """Mark the request of a followed stream (with notice, name it in the notices now);
        whether it was. It counts as marked while it is being marked, so a switch to
        notices meanwhile does not mark it again."""
        reader.marked.add(key)
        try:
            marked = await self.mark_followed(_request_of(key), notice)
        except Exception as exc:  # its events come later, not never: every stream is read every full_read_every_s
            log.debug("marking %s followed failed: %s", key, exc)
            marked = False
        if not marked:
            reader.marked.discard(key)
        return marked

    async def _read_noticed(self, reader: _ShardReader, connection: Redis) -> None:
        """Wait for the shard's notices, then read the streams they name (and those followed
        since the last read); every stream at first (every request followed marked first:
        those followed while the streams were few were not, and a failover may have lost
        marks) and every full_read_every_s."""
        now = asyncio.get_running_loop().time()
        if reader.notices_after is None:
            unmarked = [key for key in reader.positions if key not in reader.marked]
            await asyncio.gather(*(self._mark(reader, key) for key in unmarked))
        if reader.notices_after is None or now - reader.full_read_at >= self.full_read_every_s:
            reader.fresh.clear()
            async with connection.pipeline(transaction=False) as pipe:
                # Where the notices end, then every stream: a notice after that end names a
                # stream written after this read.
                read_from = dict(reader.positions)
                pipe.xrevrange(reader.shard.notices, count=1)
                pipe.xread(read_from, count=COUNT)
                last, reply = await pipe.execute()
            reader.notices_after = last[0][0] if last else "0-0"
            reader.full_read_at = now
            reader.again = await self._deliver(reader, reply, read_from)
            return
        keys = reader.fresh | reader.again
        reader.fresh, reader.again = set(), set()
        notices = await connection.xread(
            {reader.shard.notices: reader.notices_after}, count=COUNT, block=None if keys else BLOCK_MS
        )
        for _, entries in notices or []:
            reader.notices_after = entries[-1][0]
            for _, fields in entries:
                keys.update(reader.shard.events(request_id) for request_id in fields.get("ids", "").split())
        positions = {key: reader.positions[key] for key in keys if key in reader.positions}
        if positions:
            reader.again |= await self._deliver(reader, await connection.xread(positions, count=COUNT), positions)

    async def _deliver(self, reader: _ShardReader, reply: Any, read_from: dict[str, str]) -> set[str]:
        """Fan an XREAD's entries out to the streams' followers; the streams to read again at
        once (it read COUNT entries of them: more may wait; or a follower came meanwhile
        wanting entries from before where it read). The streams whose entries name a record
        (an end) wait for their records, read all at once, after the others are fanned out:
        another stream's first token never waits behind the records of the streams that
        ended."""
        again = set()
        ended = []
        for key, entries in reply or []:
            if len(entries) >= COUNT:
                again.add(key)
            if any("record" in fields for _, fields in entries):
                ended.append((key, entries))
                continue
            events = [(entry_id, _own_events(fields), _piece(fields)) for entry_id, fields in entries]
            again |= self._advance(reader, key, read_from.get(key), events)
        if ended:
            read = await asyncio.gather(*(self._entries_events(key, entries) for key, entries in ended))
            for (key, _), events in zip(ended, read, strict=True):
                again |= self._advance(reader, key, read_from.get(key), events)
        return again

    def _advance(
        self,
        reader: _ShardReader,
        key: str,
        read_from: str | None,
        events: list[tuple[str, list[tuple[str, str]], tuple[int, int] | None]],
    ) -> set[str]:
        """Hand a stream's entries, read after `read_from`, to its followers and move its
        position past them; the stream, if it must be read again at once. A follower that
        came while the read was in flight, wanting entries from before `read_from` (its
        position was set back), gets none of these now, or it would miss those between: the
        position stays where it set it, and the next read gives it all in order (the others
        skip what they have)."""
        position = reader.positions.get(key)
        if position is None or read_from is None or stream_id_order(position) >= stream_id_order(read_from):
            if position is not None:
                reader.positions[key] = events[-1][0]
            self._fan_out(reader, key, events)
            return set()
        start = stream_id_order(read_from)
        caught_up = [f for f in reader.followers.get(key, ()) if stream_id_order(read_after(f.after)) >= start]
        self._fan_out(reader, key, events, caught_up)
        return {key}

    async def _entries_events(
        self, key: str, entries: list[tuple[str, dict[str, str]]]
    ) -> list[tuple[str, list[tuple[str, str]], tuple[int, int] | None]]:
        """A stream's entries as (entry id, its (kind, data) events, its token piece), the
        records they name read."""
        events = []
        for entry_id, fields in entries:
            entry = fields.get("record")  # (the record's results entry)
            parts = _own_events(fields) if entry is None else await self._record_events(key, fields, entry)
            events.append((entry_id, parts, _piece(fields)))
        return events

    async def _record_events(self, key: str, fields: dict[str, str], entry: str) -> list[tuple[str, str]]:
        """The (kind, data) of the events of an entry that names the record's results entry:
        the terminal event gets the record, an `output` event its outputs."""
        kind = fields.get("event", "")
        record = await self.records(_request_of(key), entry)
        if kind == "output":  # (an `output` entry of its own, as FINISH wrote them before)
            return [(kind, _outputs(record))]
        return [("output", _outputs(record)), (kind, record)] if "output" in fields else [(kind, record)]

    @staticmethod
    def _fan_out(
        reader: _ShardReader,
        key: str,
        entries: list[tuple[str, list[tuple[str, str]], tuple[int, int] | None]],
        followers: list[_Follower] | None = None,
    ) -> None:
        for follower in list(reader.followers.get(key, ())) if followers is None else followers:
            after = event_order(follower.after)
            for entry_id, events, piece in entries:
                millis, seq = stream_id_order(entry_id)
                own = len(events) - 1
                for n, (kind, data) in enumerate(events):
                    order = (millis, seq, _OWN if n == own else n)
                    if order <= after:
                        continue
                    event_id = entry_id if n == own else f"{entry_id}-{n}"
                    follower.after, after = event_id, order
                    if piece is not None:
                        if follower.next_piece is not None and piece[0] < follower.next_piece:
                            continue  # pieces it has already
                        follower.next_piece = piece[0] + piece[1]
                    follower.queue.put_nowait(StreamEvent(event_id, kind, data))

    async def _end_vanished(self, reader: _ShardReader) -> None:
        keys = list(reader.followers)
        if not keys:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            found = await pipe.execute()
        for key, exists in zip(keys, found, strict=True):
            if not exists:
                for follower in reader.followers.get(key, ()):
                    follower.queue.put_nowait(None)


def _request_of(events_key: str) -> str:
    """The request id of an events stream's key (Shard.events)."""
    return events_key.rsplit(":", 1)[1]


def _outputs(record: str) -> str:
    return json.dumps(json.loads(record).get("outputs"))


def _piece(fields: dict[str, str]) -> tuple[int, int] | None:
    """A token entry's (index of its first piece, pieces it holds); None for other events."""
    return (int(fields["i"]), int(fields["n"])) if "i" in fields else None


def _own_events(fields: dict[str, str]) -> list[tuple[str, str]]:
    """The (kind, data) of an entry's events, in order: a `queued` event it carries, then
    its own."""
    own = (fields.get("event", ""), fields.get("data", "{}"))
    return [("queued", fields["queued"]), own] if "queued" in fields else [own]
