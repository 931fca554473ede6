"""The `done` channel and the waiters it wakes, on a real Redis: the message names the
requests a FINISH ended (each gateway process gets every message, so no record travels in
it); a waiter it wakes reads the record; a run of this process hands its waiters the record
itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from redis.asyncio.client import PubSub

from gateway.common.redis import RedisClients
from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import DONE_CHANNEL
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest
from gateway.server.results.notifier import CompletionNotifier
from tests.conftest import lone_redis

OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "notifier-redis") as url:
        yield url


@pytest.fixture
async def clients(redis_url: str) -> AsyncIterator[RedisClients]:
    clients = RedisClients.open(url=redis_url, cluster_nodes=[], timeout_s=5, max_connections=20)
    yield clients
    await clients.main.aclose()


@pytest.fixture
async def notifier(clients: RedisClients) -> AsyncIterator[CompletionNotifier]:
    notifier = CompletionNotifier(clients)
    await notifier.start()
    yield notifier
    await notifier.close()


async def _ended(notifier: CompletionNotifier, clients: RedisClients, request_id: str) -> str | None:
    """What a waiter of request_id is woken with when its `done` message arrives."""
    async with notifier.watch(request_id) as ended:
        await clients.main.publish(DONE_CHANNEL, request_id)
        return await asyncio.wait_for(ended, 10)


async def _started(store: JobStore) -> tuple[Job, str]:
    """A request started at once: its job and its run."""
    now = time.time()
    request_id = new_request_id(now)
    submitted = await store.submit(
        [NewRequest(request_id, {"inputs": {}}, now, now + 60)],
        model="m",
        tenant="t",
        band="normal",
        admission=OPEN,
        start_as="c1",
    )
    job = await store.load(request_id)
    assert job is not None
    return job, submitted.run


async def _next_message(pubsub: PubSub) -> str:
    deadline = time.monotonic() + 10
    while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)) is None:
        assert time.monotonic() < deadline, "no done message"
    return str(message["data"])


async def test_finish_publishes_the_request_id_alone(clients: RedisClients) -> None:
    store = JobStore(clients.main, idempotency_ttl_s=60, lease_ms=10_000, replication=clients)
    job, run = await _started(store)
    async with clients.subscription(DONE_CHANNEL) as pubsub:
        assert isinstance(await store.finish(job.record(State.SUCCEEDED), run=run), str)
        assert await _next_message(pubsub) == job.request_id


async def test_requests_finished_together_are_named_in_one_message(clients: RedisClients) -> None:
    store = JobStore(clients.main, idempotency_ttl_s=60, lease_ms=10_000, replication=clients)
    started = [await _started(store) for _ in range(3)]
    async with clients.subscription(DONE_CHANNEL) as pubsub:
        # Ready together while nothing was pending: the first FINISH goes at once, alone, and
        # the two made while it was in flight as one call (the group commit), named together.
        await asyncio.gather(*(store.finish(job.record(State.SUCCEEDED), run=run) for job, run in started))
        assert (await _next_message(pubsub)).split() == [started[0][0].request_id]
        assert (await _next_message(pubsub)).split() == [job.request_id for job, _ in started[1:]]


async def test_a_message_naming_several_requests_wakes_the_waiters_of_each(
    notifier: CompletionNotifier, clients: RedisClients
) -> None:
    async with notifier.watch("first") as first, notifier.watch("second") as second:
        await clients.main.publish(DONE_CHANNEL, "first second")
        assert await asyncio.wait_for(first, 10) is None
        assert await asyncio.wait_for(second, 10) is None


async def test_a_done_message_wakes_a_waiter_to_read_the_record(
    notifier: CompletionNotifier, clients: RedisClients
) -> None:
    assert await _ended(notifier, clients, "run-elsewhere") is None


async def test_a_run_of_this_process_hands_its_waiters_the_record_and_its_message_is_left_alone(
    notifier: CompletionNotifier, clients: RedisClients
) -> None:
    with notifier.running("ours"):
        async with notifier.watch("ours") as ended:
            await clients.main.publish(DONE_CHANNEL, "ours")
            # Messages arrive in order: once the next one has woken its waiter, ours was seen.
            assert await _ended(notifier, clients, "another") is None
            assert not ended.done()
            notifier.deliver("ours", '{"request_id": "ours"}')
            assert ended.result() == '{"request_id": "ours"}'


async def test_a_run_that_ends_without_delivering_wakes_its_waiters_to_look_again(
    notifier: CompletionNotifier,
) -> None:
    async with notifier.watch("finished by another run") as ended:
        with notifier.running("finished by another run"):
            pass
        assert ended.done() and ended.result() is None
