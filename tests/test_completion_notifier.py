"""The `done` channel and the waiters it wakes, on a real Redis: the message names the
request (each gateway process gets every message, so no record travels in it); a waiter
it wakes reads the record; a run of this process hands its waiters the record itself."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.common.redis import RedisClients
from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import DONE_CHANNEL
from gateway.server.queue.jobs import Admission, JobStore, NewRequest
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


async def test_finish_publishes_the_request_id_alone(clients: RedisClients) -> None:
    store = JobStore(clients.main, live_state_ttl_s=60, idempotency_ttl_s=60, lease_ms=10_000, replication=clients)
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
    async with clients.subscription(DONE_CHANNEL) as pubsub:
        assert isinstance(await store.finish(job.record(State.SUCCEEDED), run=submitted.run), str)
        deadline = time.monotonic() + 10
        while (message := await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)) is None:
            assert time.monotonic() < deadline, "no done message"
    assert message["data"] == request_id


async def test_a_done_message_wakes_a_waiter_to_read_the_record(
    notifier: CompletionNotifier, clients: RedisClients
) -> None:
    assert await _ended(notifier, clients, "a request run elsewhere") is None


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
