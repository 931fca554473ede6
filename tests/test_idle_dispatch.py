"""What an idle dispatcher asks of Redis: its poll for lost `work` announcements reads
each shard's backlog, and asks for work (TAKE) only where some waits. A real Redis and
the real Dispatcher, over a stand-in replica and runner (no Triton)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.common.redis import RedisClients
from gateway.protocol import ResultRecord, State
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.settings import GatewaySettings
from tests.conftest import lone_redis

MODEL = "m"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "idle-redis") as url:
        yield url


class Registry:
    names = [MODEL]
    adapters = {MODEL: SimpleNamespace(triton_model=MODEL, decoupled=False)}

    def __contains__(self, name: object) -> bool:
        return name == MODEL


class Runner:
    async def run(self, job: Job, control: Any, prepared: Any = None) -> ResultRecord:
        return job.record(State.SUCCEEDED, outputs={"text_output": "done"})


class Counted:
    """Counts the calls of an async method of an object, passing them on."""

    def __init__(self, target: Any, name: str) -> None:
        self.calls = 0
        method = getattr(target, name)

        async def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return await method(*args, **kwargs)

        setattr(target, name, counted)


@pytest.fixture
async def dispatcher(redis_url: str) -> AsyncIterator[Dispatcher]:
    clients = RedisClients.open(url=redis_url, cluster_nodes=[], timeout_s=5, max_connections=32)
    await clients.main.flushdb()
    jobs = JobStore(clients.main, idempotency_ttl_s=60, lease_ms=15_000, replication=clients)
    pool = ReplicaPool([], max_inflight=4, probe_interval_s=60, probe_timeout_s=1)
    # A replica serving the model, never called (nothing waits): the dispatcher has room.
    pool.replicas.append(Replica("stand-in:1", None, 4, healthy=True, ready_models=frozenset({MODEL})))
    dispatcher = Dispatcher(
        redis=clients,
        consumer="idle",
        jobs=jobs,
        pool=pool,
        registry=Registry(),  # type: ignore[arg-type]
        runner=Runner(),  # type: ignore[arg-type]
        settings=GatewaySettings(),
        metrics=GatewayMetrics(),
        notifier=CompletionNotifier(clients),
    )
    yield dispatcher
    await dispatcher.stop(drain_s=0)
    await clients.aclose()


async def _until(check: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def test_an_idle_dispatchers_poll_asks_no_shard_for_work_where_none_waits(dispatcher: Dispatcher) -> None:
    polls = Counted(dispatcher, "_poll")
    takes = Counted(dispatcher.jobs, "take")
    await dispatcher.start()
    await _until(lambda: polls.calls >= 1)  # past the look at every shard as it subscribed
    takes.calls = 0
    await _until(lambda: polls.calls >= 3)
    assert takes.calls == 0
