"""Server-Sent Events from the requests' event streams, with one Redis reader per shard
and process: a single XREAD BLOCK covers every stream of that shard some client follows
and fans the entries out, so a thousand SSE clients cost one connection per shard. A new
client interrupts the blocked read (CLIENT UNBLOCK) so its stream is read at once.

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
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.common.retry import LoopHealth, supervise
from gateway.common.streams import stream_id_order
from gateway.protocol import EventKind
from gateway.protocol.redis_keys import Shard, shard_of

log = logging.getLogger(__name__)

TERMINAL_KINDS = {kind.value for kind in EventKind if kind.terminal}
BLOCK_MS = 1000
# A followed stream is checked for existence this often (it may have expired).
EXISTS_EVERY_S = 30.0


class TooManyStreams(Exception):
    pass


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


class EventHub:
    def __init__(
        self,
        redis: Redis,
        connect_reader: Callable[[Shard], Awaitable[Redis]],
        records: Callable[[str, str], Awaitable[str]],
        *,
        max_followers: int = 10_000,
    ) -> None:
        """connect_reader(shard) gives a client of one connection to the Redis that holds
        the shard, for blocking reads (its id can be unblocked); records(request id,
        results entry) gives a record (from Redis, or MongoDB once stored)."""
        self.redis = redis  # for checks
        self.connect_reader = connect_reader
        self.records = records
        self.max_followers = max_followers
        self._readers: dict[int, _ShardReader] = {}
        self._closed = False

    async def start(self) -> None:
        """Readers start with their first follower."""

    async def close(self) -> None:
        self._closed = True
        for reader in self._readers.values():
            if reader.task:
                reader.task.cancel()
        await asyncio.gather(*(r.task for r in self._readers.values() if r.task), return_exceptions=True)
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

    async def follow(self, request_id: str, after: str) -> AsyncIterator[StreamEvent]:
        """The events of a request after `after`, up to and including the terminal one.
        Ends early (returns) if the stream disappears."""
        async for event in self.follow_idle(request_id, after, idle_s=None):
            if event is not None:
                yield event

    async def follow_idle(
        self, request_id: str, after: str, *, idle_s: float | None
    ) -> AsyncIterator[StreamEvent | None]:
        """As follow(), and, until the request has started, None whenever nothing came for
        idle_s (for the caller to say something meanwhile)."""
        if self.followers >= self.max_followers:
            raise TooManyStreams(f"{self.max_followers} event streams are being followed")
        shard = shard_of(request_id)
        reader = self._reader(shard)
        follower = _Follower(shard.events(request_id), after, 0 if after == "0-0" else None)
        reader.followers.setdefault(follower.key, set()).add(follower)
        position, start = reader.positions.get(follower.key), read_after(after)
        if position is None or stream_id_order(start) < stream_id_order(position):
            reader.positions[follower.key] = start
        await self._interrupt(reader)
        try:
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

    def _reader(self, shard: Shard) -> _ShardReader:
        reader = self._readers.get(shard.index)
        if reader is None:
            reader = self._readers[shard.index] = _ShardReader(shard)
        if reader.task is None and not self._closed:
            reader.health = LoopHealth(f"event reader {shard.prefix}")
            reader.task = asyncio.create_task(supervise(reader.health, lambda: self._run(reader)), name="event-hub")
        return reader

    async def _interrupt(self, reader: _ShardReader) -> None:
        """Make the blocked XREAD return so the next one includes the new stream."""
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
            while True:
                if not reader.followers:
                    reader.changed.clear()
                    await reader.changed.wait()
                    continue
                reader.changed.clear()
                reply = await connection.xread(dict(reader.positions), count=512, block=BLOCK_MS)
                for key, entries in reply or []:
                    events = []
                    for entry_id, fields in entries:
                        piece = (int(fields["i"]), int(fields["n"])) if "i" in fields else None
                        entry = fields.get("record")  # (the record's results entry)
                        parts = _own_events(fields) if entry is None else await self._record_events(key, fields, entry)
                        events.append((entry_id, parts, piece))
                    if key in reader.positions:
                        reader.positions[key] = entries[-1][0]
                    self._fan_out(reader, key, events)
                if loop.time() - last_exists_check > EXISTS_EVERY_S:
                    last_exists_check = loop.time()
                    await self._end_vanished(reader)
        finally:
            reader.connection_id = None
            reader.connection = None
            await connection.aclose()

    async def _record_events(self, key: str, fields: dict[str, str], entry: str) -> list[tuple[str, str]]:
        """The (kind, data) of the events of an entry that names the record's results entry:
        the terminal event gets the record, an `output` event its outputs."""
        kind = fields.get("event", "")
        record = await self.records(key.rsplit(":", 1)[1], entry)
        if kind == "output":  # (an `output` entry of its own, as FINISH wrote them before)
            return [(kind, _outputs(record))]
        return [("output", _outputs(record)), (kind, record)] if "output" in fields else [(kind, record)]

    @staticmethod
    def _fan_out(
        reader: _ShardReader, key: str, entries: list[tuple[str, list[tuple[str, str]], tuple[int, int] | None]]
    ) -> None:
        for follower in list(reader.followers.get(key, ())):
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


def _outputs(record: str) -> str:
    return json.dumps(json.loads(record).get("outputs"))


def _own_events(fields: dict[str, str]) -> list[tuple[str, str]]:
    """The (kind, data) of an entry's events, in order: a `queued` event it carries, then
    its own."""
    own = (fields.get("event", ""), fields.get("data", "{}"))
    return [("queued", fields["queued"]), own] if "queued" in fields else [own]
