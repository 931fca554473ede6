"""Server-Sent Events from the requests' event streams, with one Redis reader per
process: a single XREAD BLOCK covers every stream some client follows and fans the
entries out, so a thousand SSE clients cost one connection. A new client interrupts the
blocked read (CLIENT UNBLOCK) so its stream is read at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from redis.asyncio import Redis

from gateway.common.retry import LoopHealth, supervise
from gateway.common.streams import stream_id_order
from gateway.protocol import EventKind
from gateway.protocol.redis_keys import events_key

log = logging.getLogger(__name__)

TERMINAL_KINDS = {kind.value for kind in EventKind if kind.terminal}
BLOCK_MS = 1000
# A followed stream is checked for existence this often (it may have expired).
EXISTS_EVERY_S = 30.0


class TooManyStreams(Exception):
    pass


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
    queue: asyncio.Queue[StreamEvent | None] = field(default_factory=asyncio.Queue)


class EventHub:
    def __init__(self, redis: Redis, blocking: Redis, *, max_followers: int = 10_000) -> None:
        self.redis = redis  # for CLIENT UNBLOCK and checks
        self.blocking = blocking
        self.max_followers = max_followers
        self._followers: dict[str, set[_Follower]] = {}
        self._changed = asyncio.Event()
        self._reader: Redis | None = None
        self._reader_id: int | None = None
        self._task: asyncio.Task[None] | None = None
        self.health = LoopHealth("event hub")

    async def start(self) -> None:
        self._task = asyncio.create_task(supervise(self.health, self._run), name="event-hub")

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for followers in self._followers.values():
            for follower in followers:
                follower.queue.put_nowait(None)
        if self._reader is not None:
            await self._reader.aclose()

    @property
    def followers(self) -> int:
        return sum(len(f) for f in self._followers.values())

    async def follow(self, request_id: str, after: str) -> AsyncIterator[StreamEvent]:
        """The events of a request after `after`, up to and including the terminal one.
        Ends early (returns) if the stream disappears."""
        if self.followers >= self.max_followers:
            raise TooManyStreams(f"{self.max_followers} event streams are being followed")
        follower = _Follower(events_key(request_id), after)
        self._followers.setdefault(follower.key, set()).add(follower)
        await self._interrupt()
        try:
            while True:
                event = await follower.queue.get()
                if event is None:
                    return
                yield event
                if event.terminal:
                    return
        finally:
            followers = self._followers.get(follower.key)
            if followers is not None:
                followers.discard(follower)
                if not followers:
                    del self._followers[follower.key]

    async def _interrupt(self) -> None:
        """Make the blocked XREAD return so the next one includes the new stream."""
        self._changed.set()
        if self._reader_id is not None:
            try:
                await self.redis.client_unblock(self._reader_id)
            except Exception as exc:  # the reader is reconnecting; it reads all streams when back
                log.debug("unblocking the event reader failed: %s", exc)

    async def _run(self) -> None:
        # One connection of our own, so its id can be unblocked.
        self._reader = Redis(connection_pool=self.blocking.connection_pool, single_connection_client=True)
        loop = asyncio.get_running_loop()
        last_exists_check = loop.time()
        try:
            self._reader_id = await self._reader.client_id()
            while True:
                if not self._followers:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                self._changed.clear()
                streams = {key: min((f.after for f in fs), key=stream_id_order) for key, fs in self._followers.items()}
                reply = await self._reader.xread(streams, count=512, block=BLOCK_MS)
                for key, entries in reply or []:
                    self._fan_out(key, entries)
                if loop.time() - last_exists_check > EXISTS_EVERY_S:
                    last_exists_check = loop.time()
                    await self._end_vanished()
        finally:
            self._reader_id = None
            reader, self._reader = self._reader, None
            if reader is not None:
                await reader.aclose()

    def _fan_out(self, key: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        for follower in list(self._followers.get(key, ())):
            after = stream_id_order(follower.after)
            for entry_id, fields in entries:
                if stream_id_order(entry_id) <= after:
                    continue
                follower.after = entry_id
                follower.queue.put_nowait(StreamEvent(entry_id, fields.get("event", ""), fields.get("data", "{}")))

    async def _end_vanished(self) -> None:
        keys = list(self._followers)
        if not keys:
            return
        async with self.redis.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.exists(key)
            found = await pipe.execute()
        for key, exists in zip(keys, found, strict=True):
            if not exists:
                for follower in self._followers.get(key, ()):
                    follower.queue.put_nowait(None)
