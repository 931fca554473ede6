"""Token events of one run, coalesced and never lost.

The first piece goes out at once, later ones at most one event per window (or per
`max_pieces`), so Redis writes grow with time rather than with tokens. Each event carries
the index of its first piece and how many it holds, so indexes stay exact for resuming
clients.

Every piece is kept until Redis has it. A write that fails (Redis away, or restarting) is
retried with backoff while the run goes on; EMIT is idempotent by index, so a write
replayed after a lost reply adds nothing, and a stream that holds fewer pieces than were
sent (a Redis that lost its last writes) is refilled from where it stops ('gap'). The
run's FINISH checks the count once more, so the joined pieces always equal the final
text. Every write is fenced by the run's attempt; a write that finds the run stale ends
the run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.common.redis import REDIS_OUTAGE
from gateway.server.models import Piece
from gateway.server.queue.jobs import Emitted, JobStore

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


class StaleRun(Exception):
    """Another run took this request over (this one was presumed dead)."""


class LostPieces(Exception):
    """The stream lost pieces of an earlier run that this run cannot send again."""


class TokenEmitter:
    def __init__(
        self,
        jobs: JobStore,
        request_id: str,
        attempt: int,
        *,
        first_index: int,
        window_s: float,
        max_pieces: int,
        on_cancel: Callable[[], None],
    ) -> None:
        self.jobs = jobs
        self.request_id = request_id
        self.attempt = attempt
        self.first_index = first_index  # pieces before it were sent by earlier runs
        self.window_s = window_s
        self.max_pieces = max_pieces
        self.on_cancel = on_cancel
        self.pieces: list[Piece] = []  # every piece of this run, from first_index on
        self.sent = first_index  # pieces Redis holds
        self._last_flush = 0.0
        self._timer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._retry_s = 0.0
        self._error: BaseException | None = None

    @property
    def total(self) -> int:
        return self.first_index + len(self.pieces)

    async def add(self, pieces: list[Piece]) -> None:
        if self._error is not None:
            raise self._error
        self.pieces.extend(pieces)
        if self.total == self.sent or self._timer is not None:
            return
        due = self._last_flush + max(self.window_s, self._retry_s)
        if not self._retry_s and (self.total - self.sent >= self.max_pieces or time.monotonic() >= due):
            await self._flush_or_retry_later()
        else:
            self._timer = asyncio.create_task(self._flush_at(due))

    async def _flush_at(self, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        self._timer = None
        try:
            await self._flush_or_retry_later()
        except BaseException as exc:  # reported by the next add() or close()
            self._error = exc

    async def _flush_or_retry_later(self) -> None:
        try:
            await self.flush()
            self._retry_s = 0.0
        except REDIS_OUTAGE as exc:
            self._retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, self._retry_s * 2))
            log.warning("request %s: token events wait for Redis (%s)", self.request_id, type(exc).__name__)
            if self._timer is None:
                self._timer = asyncio.create_task(self._flush_at(time.monotonic() + self._retry_s))

    async def flush(self) -> None:
        """Send what Redis does not hold yet, as one event."""
        async with self._lock:
            if self.total == self.sent:
                return
            start = self.sent - self.first_index
            if start < 0:
                raise LostPieces(f"{self.request_id}: the stream lost pieces of an earlier run")
            batch = self.pieces[start:]
            text = "".join(p.text for p in batch)
            ids = [i for p in batch for i in p.ids]
            self._last_flush = time.monotonic()
            reply: Emitted = await self.jobs.emit(self.request_id, self.attempt, self.sent, text, len(batch), ids)
            if reply.outcome == "stale":
                raise StaleRun(self.request_id)
            if reply.outcome == "gap":
                log.warning(
                    "request %s: the event stream holds %d pieces, not %d; sending again from there",
                    self.request_id,
                    reply.emitted,
                    self.sent,
                )
                self.sent = reply.emitted
                return
            self.sent = max(self.sent, reply.emitted)
            if reply.outcome == "cancel":
                self.on_cancel()

    async def close(self, deadline: float) -> None:
        """Send everything (the run ended), retrying while Redis is away, until deadline
        (time.time())."""
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        if isinstance(self._error, StaleRun | LostPieces):
            raise self._error
        await self.refill(deadline)

    async def refill(self, deadline: float, emitted: int | None = None) -> None:
        """Make Redis hold every piece (from `emitted`, when FINISH found a gap)."""
        if emitted is not None:
            self.sent = min(self.sent, emitted)
        delay = RETRY_FIRST_S
        while self.total > self.sent:
            try:
                await self.flush()
                continue
            except REDIS_OUTAGE:
                if time.time() >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)

    def discard(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
