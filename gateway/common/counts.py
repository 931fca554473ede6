"""What one request makes the process do, counted (REQUEST_COUNTS, a debug setting): tasks
created, event-loop iterations it ran in, Redis round trips, gRPC calls, JSON encodes.

A request's Counts ride in a context variable set where its call is served
(gateway.server.api.hot): every task, callback and future callback it causes runs in a
copy of that context, so what it causes anywhere in the process (the dispatcher's task of
its run, the group commit's sender, the shared Triton call) is counted to it, and what
other requests cause is not. Off (the default) nothing is installed and `begin` is one
global read: the hooks exist only once `enable` has run.

How each is counted, exactly:
- tasks: a task factory on the loop counts a task to the request whose context creates it;
  the task that serves the call (made by the HTTP server) counts as the first;
- iterations: the loop's `_run_once` numbers its iterations and every callback run
  (asyncio.Handle._run: task steps, future callbacks, timers) counts its iteration to the
  request of its context once; the pure-Python asyncio loop only (uvloop's handles are
  compiled), so with REQUEST_COUNTS the server runs on it (gateway.server.serve);
- Redis round trips: a write of commands to a connection (one pipeline is one);
- gRPC calls: a unary or streaming call started on a grpc.aio channel;
- JSON encodes: json.JSONEncoder.encode (json.dumps too) and pydantic's model_dump_json.
The counts are structure, not time: the same on any machine, at any load (tests pin them).
"""

from __future__ import annotations

import asyncio
import contextvars
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

ENABLED = False
_current: contextvars.ContextVar[Counts | None] = contextvars.ContextVar("gateway_request_counts", default=None)
_iteration = 0  # the loop iteration running now (counted only while enabled)

HEADER = b"x-gateway-counts"
TASKS_HEADER = b"x-gateway-tasks"


@dataclass
class Counts:
    tasks: int = 1  # the task serving the call
    iterations: int = 1  # the iteration it begins in
    redis: int = 0
    grpc: int = 0
    json: int = 0
    _last: int = -1  # the iteration last counted
    made: list[str] = field(default_factory=list)  # the tasks' coroutines, by name (x-gateway-tasks)

    def text(self) -> str:
        return f"tasks={self.tasks},iterations={self.iterations},redis={self.redis},grpc={self.grpc},json={self.json}"


def parse(text: str) -> dict[str, int]:
    """An x-gateway-counts header as {name: count}."""
    return {name: int(value) for name, value in (part.split("=", 1) for part in text.split(","))}


def begin() -> Counts | None:
    """Counts for the call being served from here on, in this context; None when off."""
    if not ENABLED:
        return None
    counts = Counts(_last=_iteration)
    _current.set(counts)
    return counts


def sending(send: Callable[[Any], Awaitable[None]], counts: Counts) -> Callable[[Any], Awaitable[None]]:
    """An ASGI send that adds the counts so far to the response's headers."""

    async def counted(message: Any) -> None:
        if message["type"] == "http.response.start":
            made = " ".join(counts.made).encode()
            message = {
                **message,
                "headers": [*message.get("headers", []), (HEADER, counts.text().encode()), (TASKS_HEADER, made)],
            }
        await send(message)

    return counted


def _bump(name: str) -> None:
    counts = _current.get()
    if counts is not None:
        setattr(counts, name, getattr(counts, name) + 1)


def enable(loop: asyncio.AbstractEventLoop) -> None:
    """Install the hooks (once, on the serving loop); debug only: they cost every callback."""
    global ENABLED
    if ENABLED:
        return
    ENABLED = True

    def task_factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        counts = _current.get()
        if counts is not None:
            counts.tasks += 1
            counts.made.append(getattr(coro, "__qualname__", type(coro).__name__))
        return asyncio.Task(coro, loop=loop, **kwargs)

    loop.set_task_factory(task_factory)

    run_once = getattr(loop, "_run_once", None)
    if run_once is not None:  # the pure-Python loop: iterations counted

        def numbered() -> None:
            global _iteration
            _iteration += 1
            run_once()

        loop._run_once = numbered  # type: ignore[attr-defined]
        handle_run = asyncio.Handle._run

        def counted_run(self: asyncio.Handle) -> None:
            counts = self._context.get(_current)  # type: ignore[attr-defined]
            if counts is not None and counts._last != _iteration:
                counts._last = _iteration
                counts.iterations += 1
            handle_run(self)

        asyncio.Handle._run = counted_run  # type: ignore[method-assign]

    from redis.asyncio.connection import AbstractConnection

    from gateway.common.redis import _ClosedWriteIsConnectionError

    # The gateway's connections write by their own method (without redis-py's), others by redis-py's.
    for connection in (AbstractConnection, _ClosedWriteIsConnectionError):
        connection.send_packed_command = _counted_write(connection.send_packed_command)  # type: ignore[method-assign]

    from grpc.aio import _channel

    for name in (
        "UnaryUnaryMultiCallable",
        "UnaryStreamMultiCallable",
        "StreamUnaryMultiCallable",
        "StreamStreamMultiCallable",
    ):
        multicallable = getattr(_channel, name)
        multicallable.__call__ = _counting(multicallable.__call__, "grpc")

    json.JSONEncoder.encode = _counting(json.JSONEncoder.encode, "json")  # type: ignore[method-assign]
    from pydantic import BaseModel

    BaseModel.model_dump_json = _counting(BaseModel.model_dump_json, "json")  # type: ignore[method-assign]


def _counted_write(send_packed: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
    async def counted_send(self: Any, command: Any, check_health: bool = True) -> None:
        _bump("redis")
        await send_packed(self, command, check_health)

    return counted_send


def _counting(function: Callable[..., Any], name: str) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        _bump(name)
        return function(*args, **kwargs)

    return counted
