"""bench/footprint.py counts what runs under gateway/ for the traced request only: the code of
a context it marks, and of the tasks that context starts; not what runs elsewhere meanwhile."""

from __future__ import annotations

import asyncio
import contextvars
import sys
from typing import Any

from bench import footprint
from gateway.common.streams import stream_id_order
from gateway.protocol.redis_keys import shard_of

STREAMS = footprint.PACKAGE + "common/streams.py"
KEYS = footprint.PACKAGE + "protocol/redis_keys.py"


def _traced(run: Any) -> footprint.Trace:
    trace = footprint.Trace()
    sys.settrace(trace.call)
    try:
        run()
    finally:
        sys.settrace(None)
    return trace


def test_only_the_marked_contexts_code_is_counted() -> None:
    def marked() -> None:
        footprint._traced.set(True)
        shard_of("01JABCDEFGHJKMNPQRSTVWXYZ0")

    def both() -> None:
        stream_id_order("1-2")  # outside the request's context: not counted
        contextvars.copy_context().run(marked)

    files = set(_traced(both).lines)
    assert KEYS in files
    assert STREAMS not in files


def test_a_task_the_marked_request_starts_is_counted() -> None:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await asyncio.create_task(asyncio.sleep(0, stream_id_order("1-2")))

    async def serve() -> None:
        await footprint.marked(app)({"type": "http", "headers": [(footprint.HEADER, b"1")]}, None, None)

    assert set(_traced(lambda: asyncio.run(serve())).lines) == {STREAMS}
