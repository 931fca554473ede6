"""The token writer waits out a full Redis as it waits out an outage: its pieces are kept
and written once Redis has room, and the run goes on (no re-run)."""

from __future__ import annotations

import asyncio
import time

from redis.exceptions import OutOfMemoryError, ResponseError

from gateway.server.dispatch.emitter import TokenEmitter
from gateway.server.models import Piece
from gateway.server.queue.jobs import Emitted, TokenEvent


class FullThenRoomy:
    """A relay whose Redis refuses the first writes at its maxmemory, then takes them."""

    def __init__(self, refusals: list[Exception]) -> None:
        self.refusals = refusals
        self.written: list[str] = []

    async def emit(self, event: TokenEvent, *, urgent: bool = False) -> Emitted:
        if self.refusals:
            raise self.refusals.pop(0)
        self.written.append(event.text)
        return Emitted("ok", "1-0", event.index + event.count)


async def test_pieces_refused_by_a_full_redis_are_written_once_it_has_room() -> None:
    oom = ResponseError("Error running script: OOM command not allowed when used memory > 'maxmemory'.")
    relay = FullThenRoomy([OutOfMemoryError("command not allowed when used memory > 'maxmemory'."), oom])
    emitter = TokenEmitter(relay, "r", "t", first_index=0, on_cancel=lambda: None)  # type: ignore[arg-type]
    await emitter.add([Piece("Hel", (1,))])
    await emitter.settle()  # the write behind the run met the full Redis, and waits for it
    await emitter.add([Piece("lo", (2,))])
    await emitter.close(time.time() + 10)
    assert "".join(relay.written) == "Hello" and emitter.sent == 2


def test_an_error_not_redis_s_still_ends_the_writes() -> None:
    relay = FullThenRoomy([ValueError("a bug")])
    emitter = TokenEmitter(relay, "r", "t", first_index=0, on_cancel=lambda: None)  # type: ignore[arg-type]

    async def run() -> None:
        await emitter.add([Piece("x", (1,))])
        await emitter.close(time.time() + 1)

    try:
        asyncio.run(run())
    except ValueError:
        return
    raise AssertionError("a bug was taken for a full Redis")
