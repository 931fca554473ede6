"""Token events of one run, coalesced and never lost.

The first piece goes out at once; later ones travel with everything the run produced
while its previous event was being written (and, through the relay, with the other
streams' events of the same window), so Redis writes grow with time rather than with
tokens. Writes happen behind the run: adding pieces never waits for Redis, so the run keeps
reading its replica's responses while an event is in flight, and they accumulate for the
next one. Each event carries the index of its first piece and how many it holds, so
indexes stay exact for resuming clients.

Every piece is kept until Redis has it. A write that fails (Redis away, restarting, or
full: it refuses writes at its maxmemory until results are stored and expire) is tried
again, with backoff, at the next piece and at the end, while the run goes on;
EMIT is idempotent by index, so a write replayed after a lost reply adds nothing, and a
stream that holds fewer pieces than were sent (a Redis that lost its last writes) is
refilled from where it stops ('gap'). The run's FINISH checks the count once more, so
the joined pieces always equal the final text. Every write is fenced by the run's
token; a write that finds the run stale ends the run."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from gateway.common import tracing
from gateway.common.redis import waits_for_redis
from gateway.server.dispatch.relay import TokenRelay
from gateway.server.errors import LostPieces, StaleRun
from gateway.server.models import Piece
from gateway.server.queue.jobs import TokenEvent

log = logging.getLogger(__name__)

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0


class TokenEmitter:
    def __init__(
        self,
        relay: TokenRelay,
        request_id: str,
        run: str,
        *,
        first_index: int,
        on_cancel: Callable[[], None],
    ) -> None:
        self.relay = relay
        self.request_id = request_id
        self.run = run  # the run's token (its fence)
        self.first_index = first_index  # pieces before it were sent by earlier runs
        self.on_cancel = on_cancel
        self.pieces: list[Piece] = []  # every piece of this run, from first_index on
        self.sent = first_index  # pieces Redis holds
        # Where each event sent began: pieces written again (Redis lost them) go in the same
        # events, so a reader that had them can tell them by their index and skip them.
        self._starts: list[int] = []
        self._retry_s = 0.0
        self._retry_at = 0.0
        self._writing: asyncio.Task[None] | None = None  # the writes behind the run
        self._failed: Exception | None = None  # what ended them (StaleRun, LostPieces)

    @property
    def total(self) -> int:
        return self.first_index + len(self.pieces)

    async def add(self, pieces: list[Piece]) -> None:
        """Take new pieces; Redis gets what it lacks behind the run (unless Redis is being
        waited for). Raises what ended the writes: StaleRun ends the run."""
        self._raise_failure()
        self.pieces.extend(pieces)
        if self.total == self.sent or self._writing is not None or time.monotonic() < self._retry_at:
            return
        self._writing = asyncio.create_task(self._write_behind())

    async def _write_behind(self) -> None:
        """One event after another while there are pieces Redis lacks: what arrives during
        a write goes in the next."""
        try:
            while self.total > self.sent and time.monotonic() >= self._retry_at:
                try:
                    first = self.sent == self.first_index
                    await self.flush(urgent=first)  # the first event: at once
                    if first:
                        tracing.mark("emit.first_event")  # from the replica call's start (its span)
                    self._retry_s = 0.0
                except Exception as exc:
                    if not waits_for_redis(exc):
                        raise
                    self._retry_s = min(RETRY_MAX_S, max(RETRY_FIRST_S, self._retry_s * 2))
                    self._retry_at = time.monotonic() + self._retry_s
                    log.warning("request %s: token events wait for Redis (%s)", self.request_id, type(exc).__name__)
        except Exception as exc:  # StaleRun, LostPieces, or a fault: the run learns it at its next piece
            self._failed = exc
        finally:
            self._writing = None

    def _raise_failure(self) -> None:
        if self._failed is not None:
            raise self._failed

    async def settle(self) -> None:
        """Wait for the writes behind the run (then nothing else writes)."""
        writing = self._writing
        if writing is not None:
            await asyncio.wait({writing})
        self._raise_failure()

    async def flush(self, *, urgent: bool = False) -> None:
        """Send what Redis does not hold yet, as one event."""
        if self.total == self.sent:
            return
        start = self.sent - self.first_index
        if start < 0:
            raise LostPieces(f"{self.request_id}: the stream lost pieces of an earlier run")
        end = next((s for s in self._starts if s > self.sent), self.total)
        batch = self.pieces[start : end - self.first_index]
        event = TokenEvent(
            self.request_id,
            self.run,
            self.sent,
            "".join(p.text for p in batch),
            len(batch),
            [i for p in batch for i in p.ids],
        )
        reply = await self.relay.emit(event, urgent=urgent)
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
        if reply.event_id and (not self._starts or event.index > self._starts[-1]):
            self._starts.append(event.index)
        self.sent = max(self.sent, reply.emitted)
        if reply.outcome == "cancel":
            self.on_cancel()

    async def close(self, deadline: float) -> None:
        """Send everything (the run ended), retrying while Redis is away, until deadline
        (time.time())."""
        await self.refill(deadline)

    async def refill(self, deadline: float, emitted: int | None = None) -> None:
        """Make Redis hold every piece (from `emitted`, when FINISH found a gap)."""
        await self.settle()
        if emitted is not None:
            self.sent = min(self.sent, emitted)
        delay = RETRY_FIRST_S
        while self.total > self.sent:
            try:
                await self.flush(urgent=True)
                continue
            except Exception as exc:
                if not waits_for_redis(exc) or time.time() >= deadline:
                    raise
            await asyncio.sleep(delay)
            delay = min(RETRY_MAX_S, delay * 2)
