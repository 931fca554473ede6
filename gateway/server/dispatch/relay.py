"""The token relay: every token event this process writes goes through it, and it writes
them per shard in one EMIT call: at once when no call of the shard is in flight, else with
everything that gathered while it was (batched when there is a queue, never waiting for
one). With TOKEN_WINDOW_MS above 0 it also holds events up to that long to gather more
(fewer calls at many streams, for that much latency a token).

A stream's first event (its time to first token) and a run's last ones never wait for a
window: they go at once, with whatever else is pending for the shard."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.protocol.redis_keys import Shard, shard_of
from gateway.server import spine
from gateway.server.queue.jobs import Emitted, JobStore, TokenEvent


@dataclass
class _Pending:
    events: list[TokenEvent] = field(default_factory=list)
    waiters: list[asyncio.Future[Emitted]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None
    sending: asyncio.Task[None] | None = None
    urgent: bool = False  # send right after the call in flight


class TokenRelay:
    def __init__(self, jobs: JobStore, *, window_s: float) -> None:
        self.jobs = jobs
        self.window_s = window_s
        self._shards: dict[int, _Pending] = {}

    async def emit(self, event: TokenEvent, *, urgent: bool = False) -> Emitted:
        """Write one token event (with the others of its window); urgent: now."""
        shard = shard_of(event.request_id)
        pending = self._shards.setdefault(shard.index, _Pending())
        waiter: asyncio.Future[Emitted] = asyncio.get_running_loop().create_future()
        pending.events.append(event)
        pending.waiters.append(waiter)
        if urgent:
            pending.urgent = True
        self._schedule(shard, pending)
        return await waiter

    def _schedule(self, shard: Shard, pending: _Pending) -> None:
        if pending.sending is not None or not pending.events:
            return  # the call in flight schedules the next one when it ends
        if pending.urgent or self.window_s <= 0:
            if pending.timer is not None:
                pending.timer.cancel()
                pending.timer = None
            pending.sending = asyncio.ensure_future(self._send(shard, pending))
        elif pending.timer is None:
            pending.timer = asyncio.get_running_loop().call_later(self.window_s, self._due, shard, pending)

    def _due(self, shard: Shard, pending: _Pending) -> None:
        pending.timer = None
        if pending.sending is None and pending.events:
            pending.sending = asyncio.ensure_future(self._send(shard, pending))

    async def _send(self, shard: Shard, pending: _Pending) -> None:
        events, waiters = pending.events, pending.waiters
        pending.events, pending.waiters, pending.urgent = [], [], False
        try:
            await spine.emit(self.jobs, shard, events, waiters)  # each waiter gets its event's outcome
        finally:
            pending.sending = None
            self._schedule(shard, pending)
