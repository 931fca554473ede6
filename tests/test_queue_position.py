"""A queued request says where it stands: GET /results/<id> and its event stream carry its
position (and, once starts have been seen, when it should start), which goes down as the
queue drains. A gateway with one slot, so requests queue behind each other."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

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
