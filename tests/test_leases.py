"""A gateway's dispatcher keeps its runs however busy its event loop is, and what counts
against a request's delivery limit: a real Redis and the real Dispatcher, with a stand-in
runner (no Triton). Another gateway is played by a thread of the test with its own
connection, sweeping (RECLAIM) and taking (TAKE) as any gateway does."""

from __future__ import annotations

import asyncio
import gc
import secrets
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import redis

from gateway.common.redis import RedisClients
from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue import scripts
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest
from gateway.server.replicas import ReplicaPool
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.settings import GatewaySettings
from tests.conftest import lone_redis

SHARD = Shard(0)
OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)
MODEL = "m"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "leases-redis") as url:
        yield url


class Registry:
    """No models of its own: the test hands the dispatcher its runs (adopt)."""

    names: list[str] = []
    adapters: dict[str, Any] = {}

    def __contains__(self, name: object) -> bool:
        return False


class Runner:
    """Runs a request at once, or, with `busy` set, holds the event loop (as a process
    saturated by request work does: nothing else on the loop runs) until busy() says so."""

    def __init__(self) -> None:
        self.runs: list[tuple[str, int]] = []
        self.busy: Callable[[], bool] | None = None
        self.controls: list[weakref.ref[Any]] = []  # each run's RunControl, not kept alive

    async def run(self, job: Job, control: Any, prepared: Any = None) -> Any:
        self.runs.append((job.request_id, job.attempts))
        self.controls.append(weakref.ref(control))
        deadline = time.monotonic() + 60
        while self.busy is not None and self.busy() and time.monotonic() < deadline:
            time.sleep(0.01)  # on the loop's thread: the loop is blocked
        return job.record(State.SUCCEEDED, outputs={"text_output": "done"})


@pytest.fixture
async def gateway(redis_url: str) -> AsyncIterator[tuple[Dispatcher, Runner]]:
    clients = RedisClients.open(url=redis_url, cluster_nodes=[], timeout_s=5, max_connections=32)
    await clients.main.flushdb()
    settings = GatewaySettings(claim_idle_ms=LEASE_MS, max_deliveries=3)
    jobs = JobStore(clients.main, idempotency_ttl_s=60, lease_ms=LEASE_MS, replication=clients)
    runner = Runner()
    dispatcher = Dispatcher(
        redis=clients,
        consumer=f"busy-{secrets.token_hex(3)}",
        jobs=jobs,
        pool=ReplicaPool([], max_inflight=1, probe_interval_s=60, probe_timeout_s=1),
        registry=Registry(),  # type: ignore[arg-type]
        runner=runner,  # type: ignore[arg-type]
        settings=settings,
        metrics=GatewayMetrics(),
        notifier=CompletionNotifier(clients),
    )
    await dispatcher.start()
    yield dispatcher, runner
    await dispatcher.stop(drain_s=0)
    await clients.aclose()


# Short leases: the loop is held for several of them.
LEASE_MS = 1500


class OtherGateway(threading.Thread):
    """Another gateway's sweeper and dispatcher: reclaims lapsed leases and takes what is
    first in line, every 50 ms, on a connection of its own (the test's loop is blocked)."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url, decode_responses=True)
        self.halt = threading.Event()
        self.taken: list[str] = []
        self.swept_at = 0.0  # when its last sweep ended (time.monotonic())

    def run(self) -> None:
        reclaim = self.client.register_script(scripts.RECLAIM)
        take = self.client.register_script(scripts.TAKE)
        while not self.halt.is_set():
            swept = scripts.Reclaim(SHARD)
            reclaim(keys=swept.keys(), args=swept.args())
            token = secrets.token_hex(8)
            call = scripts.Take(SHARD, MODEL, "other", now=time.time(), lease_ms=60_000, token=token, token_ttl_s=60)
            reply = take(keys=call.keys(), args=call.args())
            if reply[0] == "run":
                self.taken.append(reply[1])
            self.swept_at = time.monotonic()
            self.halt.wait(0.05)

    def stop(self) -> None:
        self.halt.set()
        self.join(10)
        self.client.close()


async def _submit(jobs: JobStore, consumer: str = "") -> str:
    now = time.time()
    request_id = new_request_id(now)
    submitted = await jobs.submit(
        [NewRequest(request_id, {"inputs": {}}, now, now + 120)],
        model=MODEL,
        tenant="t",
        band="normal",
        admission=OPEN,
        start_as=consumer,
    )
    assert submitted.outcome == ("started" if consumer else "accepted")
    return request_id


async def _gone(dispatcher: Dispatcher, request_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while request_id in dispatcher.running:
        assert time.monotonic() < deadline, f"the run of {request_id} did not end"
        await asyncio.sleep(0.05)


async def _ended(jobs: JobStore, request_id: str, timeout: float = 60) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = await jobs.load(request_id)
        if job is not None and job.state.terminal:
            return job
        assert time.monotonic() < deadline, f"{request_id} did not end: {job}"
        await asyncio.sleep(0.05)


async def test_a_run_keeps_its_lease_while_its_event_loop_is_blocked_for_several_leases(
    gateway: tuple[Dispatcher, Runner], redis_url: str
) -> None:
    dispatcher, runner = gateway
    jobs = dispatcher.jobs
    other = OtherGateway(redis_url)
    other.start()
    try:
        request_id = await _submit(jobs, dispatcher.consumer)  # started here at once
        job = await jobs.load(request_id)
        assert job is not None and job.state == State.RUNNING
        blocked_at = time.monotonic()
        # The run holds the loop until the other gateway has swept for three leases since.
        runner.busy = lambda: other.swept_at < blocked_at + 3 * LEASE_MS / 1000
        dispatcher.adopt(job)
        await _gone(dispatcher, request_id)  # the run ended here: finished, or found stale
    finally:
        other.stop()
    assert time.monotonic() - blocked_at > 3 * LEASE_MS / 1000  # the loop was held that long
    assert other.taken == [], "another gateway took the run over while it ran"
    ended = await _ended(jobs, request_id)
    assert runner.runs == [(request_id, 1)]
    assert ended.state == State.SUCCEEDED and ended.attempts == 1
    events = [fields["event"] for _, fields in await jobs.redis.xrange(SHARD.events(request_id))]
    assert events.count("running") == 1 and events.count("completed") == 1


async def test_a_request_handed_over_more_often_than_max_deliveries_still_runs(
    gateway: tuple[Dispatcher, Runner],
) -> None:
    dispatcher, runner = gateway
    jobs = dispatcher.jobs
    limit = dispatcher.settings.max_deliveries
    request_id = await _submit(jobs)
    for i in range(limit + 2):  # more rolling deploys than the limit, each handing the run on
        job = await jobs.take(SHARD, MODEL, f"draining-{i}")
        assert isinstance(job, Job)
        assert await jobs.handover(f"draining-{i}", [(job.request_id, job.run)]) == 1
    job = await jobs.take(SHARD, MODEL, dispatcher.consumer)
    assert isinstance(job, Job) and job.attempts == limit + 3
    dispatcher.adopt(job)
    ended = await _ended(jobs, request_id)
    assert ended.state == State.SUCCEEDED, await jobs.final_record(request_id)
    assert runner.runs == [(request_id, limit + 3)]


async def test_a_request_whose_runs_died_max_deliveries_times_fails(gateway: tuple[Dispatcher, Runner]) -> None:
    dispatcher, runner = gateway
    jobs = dispatcher.jobs
    request_id = await _submit(jobs)
    for i in range(dispatcher.settings.max_deliveries):  # each run's gateway died: its lease ran out
        assert isinstance(await jobs.take(SHARD, MODEL, f"dead-{i}"), Job)
        await jobs.redis.zadd(SHARD.leases, {request_id: 0})
        assert await jobs.reclaim(SHARD) == 1
    job = await jobs.take(SHARD, MODEL, dispatcher.consumer)
    assert isinstance(job, Job)
    dispatcher.adopt(job)
    ended = await _ended(jobs, request_id)
    record = await jobs.final_record(request_id)
    assert ended.state == State.FAILED and record is not None and "too_many_attempts" in record
    assert runner.runs == []


async def test_a_finished_run_is_freed_at_once_not_by_the_garbage_collector(gateway: tuple[Dispatcher, Runner]) -> None:
    """A run's objects (its control, the dispatcher's record of it, its task) go when it
    ends. Held in a reference cycle, each run would wait for the next collection: at load,
    tens of objects a request for the collector to walk (app.py freezes what lives long)."""
    dispatcher, runner = gateway
    request_id = await _submit(dispatcher.jobs, dispatcher.consumer)
    job = await dispatcher.jobs.load(request_id)
    assert job is not None
    gc.collect()
    gc.disable()  # only reference counting frees anything now
    try:
        dispatcher.adopt(job)
        await _gone(dispatcher, request_id)
        assert (await _ended(dispatcher.jobs, request_id)).state == State.SUCCEEDED
        await asyncio.sleep(0)  # a turn for the run's task to end, had it not yet
        assert runner.controls and runner.controls[-1]() is None, "the run's control outlived the run"
    finally:
        gc.enable()
