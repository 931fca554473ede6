"""The tokenize pool's own logic (gateway.server.models.tokenize_pool): its threads are its
own, a tenant past its share of places is refused with 429 and a pool held whole with
503 (both with Retry-After), work that must not be refused is counted all the same, the
waiting jobs start by tenant in turn, and a place is held until its work ends."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator

import pytest

from gateway.server.models.tokenize_pool import THREAD_NAME_PREFIX, TokenizePool
from gateway.server.tenants.shares import PoolFull, ShareExceeded


class Gates:
    """Work that blocks its thread until the test opens its gate, and the order it ran in."""

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []

    def work(self, name: str) -> Callable[[], str]:
        gate = self.gates.setdefault(name, threading.Event())

        def run() -> str:
            self.started.append(name)
            assert gate.wait(30)
            return name

        return run

    def open(self, name: str) -> None:
        self.gates[name].set()

    def open_all(self) -> None:
        for gate in self.gates.values():
            gate.set()


@pytest.fixture
def gates() -> Iterator[Gates]:
    made = Gates()
    yield made
    made.open_all()  # no thread is left blocked


async def _started(gates: Gates, count: int) -> None:
    async with asyncio.timeout(10):
        while len(gates.started) < count:
            await asyncio.sleep(0.005)


async def test_the_work_runs_in_the_pools_named_threads() -> None:
    pool = TokenizePool(threads=1, queue=1, tenant_share=1)
    name = await pool.run("t", lambda: threading.current_thread().name)
    assert name.startswith(THREAD_NAME_PREFIX)


async def test_a_tenant_past_its_share_is_refused_429_while_another_tenant_gets_a_place(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=3, tenant_share=0.5)  # 4 places, 2 a tenant
    held = [asyncio.ensure_future(pool.run("a", gates.work(f"a{i}"))) for i in range(2)]
    await _started(gates, 1)
    with pytest.raises(ShareExceeded) as refused:
        await pool.run("a", gates.work("a2"))
    assert refused.value.code == "tenant_share_exceeded" and refused.value.headers["Retry-After"]
    other = asyncio.ensure_future(pool.run("b", gates.work("b0")))
    gates.open_all()
    assert await asyncio.gather(*held, other) == ["a0", "a1", "b0"]


async def test_a_pool_held_whole_is_refused_503_tokenizer_busy(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=1, tenant_share=0.5)  # 2 places, 1 a tenant
    held = [asyncio.ensure_future(pool.run(tenant, gates.work(tenant))) for tenant in ("a", "b")]
    await _started(gates, 1)
    with pytest.raises(PoolFull) as refused:
        await pool.run("c", gates.work("c"))
    assert refused.value.status == 503 and refused.value.code == "tokenizer_busy"
    assert refused.value.headers["Retry-After"]
    gates.open_all()
    await asyncio.gather(*held)


async def test_work_that_must_not_be_refused_runs_past_the_share_and_counts(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=1, tenant_share=0.5)
    first = asyncio.ensure_future(pool.run("a", gates.work("a0")))
    await _started(gates, 1)
    accepted = asyncio.ensure_future(pool.run("a", gates.work("a1"), refuse=False))
    await asyncio.sleep(0)
    assert pool.places.by_tenant["a"] == 2 and pool.places.held == 2
    gates.open_all()
    assert await asyncio.gather(first, accepted) == ["a0", "a1"]
    assert pool.places.held == 0 and not pool.places.by_tenant


async def test_waiting_jobs_start_by_tenant_in_turn(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=10, tenant_share=1)
    names = ["a0", "a1", "a2", "b0", "c0"]
    runs = [asyncio.ensure_future(pool.run(name[0], gates.work(name))) for name in names]
    for count, name in enumerate(["a0", "a1", "b0", "c0", "a2"], start=1):
        await _started(gates, count)
        assert gates.started[-1] == name
        gates.open(name)
    await asyncio.gather(*runs)


async def test_a_job_given_up_before_it_started_leaves_its_place(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=2, tenant_share=1)
    running = asyncio.ensure_future(pool.run("a", gates.work("a0")))
    await _started(gates, 1)
    waiting = asyncio.ensure_future(pool.run("a", gates.work("a1")))
    await asyncio.sleep(0)
    assert pool.places.held == 2
    waiting.cancel()
    await asyncio.sleep(0)
    assert pool.places.held == 1 and not pool.waiting
    gates.open("a0")
    assert await running == "a0"
    assert gates.started == ["a0"] and pool.places.held == 0


async def test_a_running_job_keeps_its_place_until_its_thread_ends(gates: Gates) -> None:
    pool = TokenizePool(threads=1, queue=1, tenant_share=1)
    running = asyncio.ensure_future(pool.run("a", gates.work("a0")))
    await _started(gates, 1)
    running.cancel()
    await asyncio.sleep(0)
    assert pool.places.held == 1  # the thread still works on it
    gates.open("a0")
    async with asyncio.timeout(10):
        while pool.places.held:
            await asyncio.sleep(0.005)
    assert pool.running == 0


async def test_an_error_of_the_work_reaches_its_caller() -> None:
    pool = TokenizePool(threads=1, queue=1, tenant_share=1)

    def fail() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError, match="bad input"):
        await pool.run("a", fail)
    assert pool.places.held == 0
