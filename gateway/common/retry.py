"""Reconnect policies (tenacity) for the long-running loops of both server roles: a
loop that loses Redis or MongoDB waits with jittered exponential backoff and goes on,
logging each failure, never spinning and never giving up. Each supervised loop keeps
its health, so /healthz can say when a worker keeps failing."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential_jitter

log = logging.getLogger(__name__)


def raise_if_cancelled() -> None:
    """End a loop whose task was asked to stop, even when the await that was interrupted
    swallowed the request. Python 3.11's asyncio.wait_for (redis-py sends every command
    through it when the client has a socket timeout) returns the result instead of
    raising CancelledError when the task is cancelled just as the wrapped call completes
    (fixed in 3.12, where wait_for is asyncio.timeout). A loop that goes on after that is
    never cancelled again, and a task group waiting for it waits for good. Loops that a
    task group runs until it cancels them call this once a turn. (Not for a task that
    has run a task group itself: on 3.11 a member failing while the group exits leaves
    that task counted as cancelled for good, CPython gh-116720.)"""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def cancel_and_wait(tasks: Iterable[asyncio.Task[Any]], *, again_after_s: float = 1.0) -> None:
    """Cancel the tasks (the long-running loops of a process that stops) and wait until
    every one has ended. A task still running again_after_s after its cancellation is
    cancelled again: on Python 3.11 an await can swallow a cancellation
    (raise_if_cancelled), and a loop that goes on would keep the process from stopping;
    its next await takes the next cancellation. Their errors are taken here, not logged
    as never retrieved."""
    pending = {task for task in tasks if not task.done()}
    ended: list[asyncio.Task[Any]] = []
    while pending:
        for task in pending:
            task.cancel()
        done, pending = await asyncio.wait(pending, timeout=again_after_s)
        ended += done
    for task in ended:
        if not task.cancelled():
            task.exception()


def _transient(exc: BaseException) -> bool:
    return not isinstance(exc, asyncio.CancelledError | KeyboardInterrupt | SystemExit)


def backoff(what: str, *, initial: float = 0.1, maximum: float = 5.0, attempts: int | None = None) -> AsyncRetrying:
    """`async for attempt in backoff("x"): with attempt: ...`: retry with backoff,
    forever unless `attempts` is given."""
    from tenacity import stop_after_attempt, stop_never

    def before_sleep(state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        delay = state.next_action.sleep if state.next_action else 0.0
        log.warning("%s failed (%s: %s); retrying in %.1fs", what, type(exc).__name__, exc, delay)

    return AsyncRetrying(
        retry=retry_if_exception(_transient),
        wait=wait_exponential_jitter(initial=initial, max=maximum),
        stop=stop_after_attempt(attempts) if attempts else stop_never,
        before_sleep=before_sleep,
        reraise=True,
    )


@dataclass
class LoopHealth:
    """How a supervised loop is doing: failing means it failed within the last window."""

    name: str
    failures: int = 0
    last_failure: float = 0.0
    last_error: str = ""

    def failing(self, window_s: float = 30.0) -> bool:
        return self.failures > 0 and time.time() - self.last_failure < window_s


async def supervise(health: LoopHealth, step: Callable[[], Awaitable[None]]) -> None:
    """Run `step` (a loop that only returns by failing) for good, restarting it with
    backoff after each failure and recording the failure in `health`."""
    async for attempt in backoff(health.name, maximum=5.0):
        with attempt:
            try:
                await step()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                health.failures += 1
                health.last_failure = time.time()
                health.last_error = f"{type(exc).__name__}: {exc}"[:300]
                raise
