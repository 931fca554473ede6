"""A loop that runs until cancelled ends when cancelled, even when the await it was in
swallowed the cancellation (gateway/common/retry.py raise_if_cancelled): Python 3.11's
asyncio.wait_for, through which redis-py sends every command, returns the result instead
of raising when the task is cancelled just as the call completes. The binder's archiver
cancels its shards' loops when one fails and waits for them (a task group): one loop
going on after that held the group, and every shard's storing, for good."""

from __future__ import annotations

import asyncio
import sys

import pytest

from gateway.common.retry import cancel_and_wait, raise_if_cancelled


async def serve(calls: asyncio.Queue[asyncio.Future[None]], *, checks: bool) -> None:
    """A loop making one call after another, each through asyncio.wait_for (as redis-py
    sends a command), the calls' futures handed to the test to complete."""
    loop = asyncio.get_running_loop()
    while True:
        if checks:
            raise_if_cancelled()
        call: asyncio.Future[None] = loop.create_future()
        calls.put_nowait(call)
        await asyncio.wait_for(call, timeout=5)


async def cancel_as_a_call_completes(checks: bool) -> tuple[asyncio.Task[None], asyncio.Queue[asyncio.Future[None]]]:
    calls: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()
    task = asyncio.create_task(serve(calls, checks=checks))
    call = await calls.get()
    call.set_result(None)  # the call completes ...
    task.cancel()  # ... and its task is cancelled before it resumes
    return task, calls


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="3.12's wait_for raises the cancellation")
async def test_wait_for_swallows_a_cancellation_that_comes_as_its_call_completes() -> None:
    task, calls = await cancel_as_a_call_completes(checks=False)
    async with asyncio.timeout(5):
        await calls.get()  # the loop went on to its next call
    assert not task.done()
    task.uncancel()
    task.cancel()  # (a second cancellation, in the middle of a call, ends it)
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_loop_that_checks_ends_when_cancelled_even_if_its_call_swallowed_it() -> None:
    task, calls = await cancel_as_a_call_completes(checks=True)
    with pytest.raises(asyncio.CancelledError):
        async with asyncio.timeout(5):
            await task
    assert calls.empty()  # no call made after the cancellation


async def test_cancel_and_wait_ends_a_loop_whose_call_swallowed_its_cancellation() -> None:
    """How a stopping process ends its loops: a loop that went on after its cancellation
    is cancelled again in its next call."""
    calls: asyncio.Queue[asyncio.Future[None]] = asyncio.Queue()
    task = asyncio.create_task(serve(calls, checks=False))
    (await calls.get()).set_result(None)  # the call completes ...
    async with asyncio.timeout(5):
        await cancel_and_wait([task], again_after_s=0.05)  # ... and its task is cancelled before it resumes
    assert task.cancelled()
    assert calls.qsize() <= 1  # at most the call the loop went on to, then cancelled in
