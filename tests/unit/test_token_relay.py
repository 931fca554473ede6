"""The token relay (dispatch/relay.py) batches when there is a queue and never waits for
one: an event alone goes at once; what comes while a shard's call is in flight goes in the
next call, together (against a stand-in store: pure logic)."""

from __future__ import annotations

import asyncio

from gateway.protocol import new_request_id
from gateway.server.dispatch.relay import TokenRelay
from gateway.server.queue.jobs import Emitted, TokenEvent


class SlowStore:
    """Records each EMIT call's events; a call ends when the test lets it."""

    def __init__(self) -> None:
        self.calls: list[list[TokenEvent]] = []
        self.release = asyncio.Event()

    async def emit_many(self, shard, events: list[TokenEvent]) -> list[Emitted]:
        self.calls.append(events)
        await self.release.wait()
        return [Emitted("ok", "1-0", e.index + e.count) for e in events]


async def turns(n: int = 5) -> None:
    """Let the loop run a few turns (no time passes: nothing here waits on a clock)."""
    for _ in range(n):
        await asyncio.sleep(0)


def event(request_id: str, index: int = 0) -> TokenEvent:
    return TokenEvent(request_id, "run", index, "x", 1, [1])


async def test_an_event_alone_goes_at_once_and_those_that_come_meanwhile_go_together() -> None:
    store = SlowStore()
    relay = TokenRelay(store, window_s=0)  # type: ignore[arg-type]
    streams = [new_request_id() for _ in range(3)]
    first = asyncio.ensure_future(relay.emit(event(streams[0])))
    await turns()
    assert len(store.calls) == 1  # sent in the turn it came: no window waited for
    later = [asyncio.ensure_future(relay.emit(event(rid, 1))) for rid in streams]
    await turns()
    assert len(store.calls) == 1  # one call of the shard in flight: they gather
    store.release.set()
    await asyncio.gather(first, *later)
    assert [len(call) for call in store.calls] == [1, 3]


def test_by_default_no_token_waits_for_a_window() -> None:
    from gateway.server.settings import GatewaySettings

    assert GatewaySettings().token_window_ms == 0
