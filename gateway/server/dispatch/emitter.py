"""Token events of one run, coalesced: the first piece goes out at once, later ones at
most one event per window (or per `max_pieces`), so Redis writes grow with time rather
than with tokens. Each event carries the index of its first piece and how many it holds,
so indexes stay consistent for resuming clients. Every write is fenced by the run's
attempt; a write that finds the run stale ends the run."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from gateway.server.models import Piece
from gateway.server.queue.jobs import JobStore


class StaleRun(Exception):
    """Another run took this request over (this one was presumed dead)."""


class TokenEmitter:
    def __init__(
        self,
        jobs: JobStore,
        request_id: str,
        attempt: int,
        *,
        window_s: float,
        max_pieces: int,
        on_cancel: Callable[[], None],
    ) -> None:
        self.jobs = jobs
        self.request_id = request_id
        self.attempt = attempt
        self.window_s = window_s
        self.max_pieces = max_pieces
        self.on_cancel = on_cancel
        self.sent_pieces = 0
        self._text: list[str] = []
        self._ids: list[int] = []
        self._count = 0
        self._last_flush = 0.0
        self._timer: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._error: BaseException | None = None

    async def add(self, pieces: list[Piece]) -> None:
        if self._error is not None:
            raise self._error
        for piece in pieces:
            self._text.append(piece.text)
            self._ids.extend(piece.ids)
            self._count += 1
        if not self._count:
            return
        due = self._last_flush + self.window_s
        if self._count >= self.max_pieces or time.monotonic() >= due:
            await self.flush()
        elif self._timer is None:
            self._timer = asyncio.create_task(self._flush_at(due))

    async def _flush_at(self, due: float) -> None:
        await asyncio.sleep(max(0.0, due - time.monotonic()))
        self._timer = None
        try:
            await self.flush()
        except BaseException as exc:  # reported by the next add() or close()
            self._error = exc

    async def flush(self) -> None:
        async with self._lock:
            if not self._count:
                return
            text, ids, count = "".join(self._text), self._ids, self._count
            self._text, self._ids, self._count = [], [], 0
            self._last_flush = time.monotonic()
            outcome = await self.jobs.emit(self.request_id, self.attempt, text, count, ids)
            if outcome == "stale":
                raise StaleRun(self.request_id)
            self.sent_pieces += count
            if outcome == "cancel":
                self.on_cancel()

    async def close(self) -> None:
        """Send what is pending (the run ended)."""
        if self._timer is not None:
            self._timer.cancel()
            await asyncio.gather(self._timer, return_exceptions=True)
            self._timer = None
        if self._error is not None:
            raise self._error
        await self.flush()

    def discard(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
