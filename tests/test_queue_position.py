"""A queued request says where it stands: GET /results/<id> and its event stream carry its
position (and, once starts have been seen, when it should start), which goes down as the
queue drains. A gateway with one slot, so requests queue behind each other. A request
read as queued always comes with its position, even when it is taken at that moment."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.protocol import State, new_request_id
from gateway.protocol.redis_keys import shard_of
from gateway.server.queue.jobs import Admission, JobStore, NewRequest
from gateway.server.results.reader import ResultReader
from tests.conftest import AUTH
from tests.gateway_calls import read_events, submit, wait_all

SLOW = {"model": "llm_synthetic", "inputs": {"text_input": "one at a time", "max_tokens": 25}}  # ~0.5 s


@pytest.fixture(scope="module")
def one_slot(stack) -> Iterator[str]:
    process, url = stack.start_gateway("gateway-one-slot", REDIS_URL=stack.redis_db_url(12), REPLICA_MAX_INFLIGHT="1")
    yield url
    stack.stop(process)


async def test_a_queued_requests_position_goes_down_as_the_queue_drains(one_slot) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=one_slot, timeout=60) as client:
        ids = [await submit(client, SLOW) for _ in range(6)]
        last = ids[-1]
        positions = []
        while (state := (await client.get(f"/results/{last}")).json())["status"] == "queued":
            positions.append(state["queue"]["position"])
            etas = state["queue"]["eta_s"]
            await client.get(f"/results/{ids[0]}", params={"wait": 1})  # a beat: the queue moves
        await wait_all(client, ids)
    assert positions[0] >= 3
    assert positions == sorted(positions, reverse=True) and positions[-1] < positions[0]
    assert etas is not None and etas > 0


async def test_the_event_stream_of_a_queued_request_says_where_it_stands(one_slot) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=one_slot, timeout=60) as client:
        ids = [await submit(client, SLOW) for _ in range(4)]
        events = await read_events(client, ids[-1])
    queue = [json.loads(e["data"]) for e in events if e["event"] == "queue"]
    assert queue, "no queue event while it waited"
    assert "id" not in next(e for e in events if e["event"] == "queue")  # nothing to resume from
    assert [q["position"] for q in queue] == sorted((q["position"] for q in queue), reverse=True)
    kinds = [e["event"] for e in events]
    assert kinds.index("queued") < kinds.index("queue") < kinds.index("running")


class _TakenAfterNextReply(aioredis.Redis):
    """A Redis client after whose next reply something else happens first (once): here, a
    dispatcher takes the request that is being read."""

    then: Callable[[], Awaitable[Any]] | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        reply = await super().execute_command(*args, **options)
        then, self.then = self.then, None
        if then is not None:
            await then()
        return reply


async def test_a_request_taken_while_it_is_read_never_reads_as_queued_without_its_position(stack) -> None:
    url = stack.redis_db_url(13)
    dispatcher = aioredis.from_url(url, decode_responses=True)
    reading = _TakenAfterNextReply.from_url(url, decode_responses=True)
    await dispatcher.flushdb()
    try:
        jobs = JobStore(dispatcher, idempotency_ttl_s=60)
        admission = Admission(max_backlog=100, max_batch_backlog=100, max_bytes=10**6)
        now = time.time()
        first, second = new_request_id(now), new_request_id(now)
        for request_id in (first, second):
            new = NewRequest(request_id, {"inputs": {}}, now, now + 60)
            await jobs.submit([new], model="m", tenant="t", band="normal", admission=admission)
        # (The store and the notifier serve ended requests only: none here.)
        reader = ResultReader(JobStore(reading, idempotency_ttl_s=60), None, None, 3600)
        await reader.get_json(second)  # the scripts are loaded: from here on a read is its calls alone
        reading.then = lambda: jobs.take(shard_of(first), "m", "dispatcher")
        _, body, status = await reader.get_json(first)
        taken = await jobs.load(first)
    finally:
        await reading.aclose()
        await dispatcher.aclose()
    assert taken is not None and taken.state == State.RUNNING  # it was taken during the read
    answer = json.loads(body)
    assert answer["status"] == status
    if status == State.QUEUED:
        assert answer["queue"] is not None and answer["queue"]["position"] == 0, answer
