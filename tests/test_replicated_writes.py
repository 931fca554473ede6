"""WAIT after a replayed script: a primary and its replica (two redis-servers started and
stopped by pid), the replica frozen (SIGSTOP) so that it confirms nothing. A SUBMIT or
FINISH whose reply was lost is sent again on another connection (as the client's retry
does: a pooled one, open since before the write). WAIT counts only the writes of its own
connection, so the replay must make one for the WAIT to cover the write it found: else a
connection that wrote nothing since the replica last confirmed is confirmed at once, by a
replica that does not hold the write.

On the local Redis 6.2 a connection's WAIT offset was seen to move with any command it
runs after writes made elsewhere (the script itself then moves it), which hides the flaw
there: these tests pass on it with or without the replay's write, and pin the end-to-end
behaviour; tests/test_queue.py checks that the replay writes (what Redis 7, whose WAIT
offset moves only with the connection's own writes, needs)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from gateway.common.redis import NotReplicated, RedisClients
from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest
from gateway.stack.process import ManagedProcess, free_port, wait_until
from gateway.stack.services import redis_spec

SHARD = Shard(0)
OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)


@pytest.fixture(scope="module")
def primary_and_replica(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ManagedProcess]]:
    data: Path = tmp_path_factory.mktemp("wait-redis")
    ports = free_port(), free_port()
    processes = [
        ManagedProcess(redis_spec(data_dir=data, host="127.0.0.1", port=port, name=f"wait-redis-{port}"))
        for port in ports
    ]
    try:
        for process in processes:
            process.start()
            process.wait_ready(time.monotonic() + 30)
        primary = redis.Redis(port=ports[0], decode_responses=True)
        replica = redis.Redis(port=ports[1], decode_responses=True)
        replica.execute_command("REPLICAOF", "127.0.0.1", ports[0])
        assert wait_until(lambda: replica.info("replication").get("master_link_status") == "up", 30)
        primary.set("synced", "1")
        assert primary.execute_command("WAIT", 1, 10_000) == 1
        primary.close()
        replica.close()
        yield f"redis://127.0.0.1:{ports[0]}/0", processes[1]
    finally:
        for process in processes:
            process.stop()


@contextmanager
def frozen(process: ManagedProcess) -> Iterator[None]:
    """The replica stops (SIGSTOP): it acknowledges nothing until it goes on (SIGCONT)."""
    assert process.pid is not None
    os.kill(process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(process.pid, signal.SIGCONT)


@pytest.fixture
async def stores(primary_and_replica: tuple[str, ManagedProcess]) -> AsyncIterator[tuple[JobStore, JobStore]]:
    """(the first try's store, whose replies are "lost"; the retry's, on connections of its
    own, which WAITs for one replica)."""
    url, _ = primary_and_replica
    first = aioredis.from_url(url, decode_responses=True)
    await first.flushdb()
    # One connection: the retry's WAIT goes on the connection _pooled() opened.
    clients = RedisClients.open(
        url=url, cluster_nodes=[], timeout_s=5, max_connections=1, wait_replicas=1, wait_timeout_ms=300
    )
    yield (
        JobStore(first, idempotency_ttl_s=60),
        JobStore(clients.main, idempotency_ttl_s=60, replication=clients),
    )
    await first.aclose()
    await clients.aclose()


async def _pooled(store: JobStore) -> None:
    """The retry's connection is open (in its pool) and the replica has confirmed all
    there was when it last wrote (it wrote nothing: all there was when it connected)."""
    assert await store.redis.execute_command("WAIT", 1, 10_000) == 1


async def _submit(store: JobStore, new: NewRequest) -> str:
    submitted = await store.submit([new], model="m", tenant="t", band="normal", admission=OPEN)
    return submitted.outcome


async def _until_confirmed(replay: Callable[[], Awaitable[bool]], timeout: float = 30) -> None:
    """Replay until a replica confirms it (the thawed replica catching up)."""
    deadline = time.monotonic() + timeout
    while not await replay():
        assert time.monotonic() < deadline, "the replica never confirmed the replay"


async def test_a_replayed_submit_is_confirmed_only_once_a_replica_has_the_write_it_found(
    stores: tuple[JobStore, JobStore], primary_and_replica: tuple[str, ManagedProcess]
) -> None:
    first, retry = stores
    _, replica = primary_and_replica
    now = time.time()
    new = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60)
    await _pooled(retry)
    with frozen(replica):
        assert await _submit(first, new) == "accepted"  # reached the primary; its reply was lost
        with pytest.raises(NotReplicated):  # the replay finds it, and no replica confirms it
            await _submit(retry, new)
    # The replica goes on and catches up: the same replay is confirmed then.

    async def confirmed() -> bool:
        try:
            return await _submit(retry, new) == "accepted"
        except NotReplicated:
            return False

    await _until_confirmed(confirmed)


async def test_a_replayed_finish_is_confirmed_only_once_a_replica_has_the_finish_it_found(
    stores: tuple[JobStore, JobStore], primary_and_replica: tuple[str, ManagedProcess], monkeypatch: pytest.MonkeyPatch
) -> None:
    first, retry = stores
    _, replica = primary_and_replica
    now = time.time()
    new = NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60)
    assert await _submit(first, new) == "accepted"
    job = await first.take(SHARD, "m", "c1")
    assert isinstance(job, Job)
    record = job.record(State.SUCCEEDED, outputs={"text_output": "x"})
    assert retry.replication is not None
    confirmed: list[Any] = []
    replicated = retry.replication.replicated

    async def counting(*args: Any) -> Any:
        reply, acked = await replicated(*args)
        confirmed.append(acked)
        return reply, acked

    monkeypatch.setattr(retry.replication, "replicated", counting)
    await _pooled(retry)
    with frozen(replica):
        assert isinstance(await first.finish(record, run=job.run), str)  # applied; its reply was lost
        assert await retry.finish(record, run=job.run) is None  # the replay finds it applied
    assert confirmed == [0]  # ... and its WAIT did not confirm what no replica held

    async def caught_up() -> bool:  # the replica goes on and catches up: confirmed then
        assert await retry.finish(record, run=job.run) is None
        return confirmed[-1] == 1

    await _until_confirmed(caught_up)
