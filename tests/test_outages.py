"""Outages of Redis under streaming load: no streamed token is lost or repeated, and a
Redis fault is not taken for a fault of the Triton replica. A Redis of its own (so the
kill touches nothing else) and a gateway on it, in front of the session's Triton."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.protocol.redis_keys import shard_of
from gateway.stack.process import ManagedProcess, free_port
from gateway.stack.services import redis_spec
from tests.conftest import AUTH
from tests.gateway_calls import read_events, submit, wait_all

STREAM = {"model": "llm_synthetic", "inputs": {"text_input": "a long story", "max_tokens": 150}, "stream": True}


@pytest.fixture(scope="module")
def redis_and_gateway(stack, tmp_path_factory) -> Iterator[tuple[ManagedProcess, str, str]]:
    data = tmp_path_factory.mktemp("outage")
    port = free_port()
    redis = ManagedProcess(redis_spec(data_dir=data, host="127.0.0.1", port=port, name="redis-outage"))
    redis.start()
    redis.wait_ready(time.monotonic() + 60)
    url = f"redis://127.0.0.1:{port}/0"
    gateway, gateway_url = stack.start_gateway("gateway-outage", REDIS_URL=url)
    yield redis, url, gateway_url
    stack.stop(gateway)
    redis.stop()


def _restart(redis: ManagedProcess) -> None:
    redis.start()  # the same port and data directory: it reloads its append-only file
    redis.wait_ready(time.monotonic() + 60)


async def _kill_and_restart(redis: ManagedProcess, down_s: float) -> None:
    redis.kill()
    await asyncio.sleep(down_s)  # the outage itself: tokens keep coming from Triton meanwhile
    await asyncio.to_thread(_restart, redis)


async def _token_events(url: str, request_id: str) -> list[dict]:
    client = aioredis.from_url(url, decode_responses=True)
    try:
        entries = await client.xrange(shard_of(request_id).events(request_id))
    finally:
        await client.aclose()
    return [json.loads(fields["data"]) for _, fields in entries if fields["event"] == "token"]


async def test_tokens_streamed_across_a_redis_kill_and_restart_join_to_the_final_text(redis_and_gateway) -> None:
    redis, url, gateway_url = redis_and_gateway
    async with httpx.AsyncClient(headers=AUTH, base_url=gateway_url, timeout=60) as client:
        ids = [await submit(client, STREAM) for _ in range(12)]
        await asyncio.sleep(0.8)  # well into their streams (150 tokens of 20 ms each)
        await _kill_and_restart(redis, down_s=1.0)
        records = await wait_all(client, ids, timeout=120)
        replayed = await read_events(client, ids[0])
    assert {r["status"] for r in records} == {"succeeded"}
    for record in records:
        tokens = await _token_events(url, record["request_id"])
        assert [t["index"] for t in tokens] == _contiguous(tokens), record["request_id"]
        assert "".join(t["text_output"] for t in tokens) == record["outputs"]["text_output"], record["request_id"]
        assert sum(t["count"] for t in tokens) == record["usage"]["completion_tokens"]
    streamed = "".join(json.loads(e["data"])["text_output"] for e in replayed if e["event"] == "token")
    assert streamed == records[0]["outputs"]["text_output"]


def _contiguous(tokens: list[dict]) -> list[int]:
    expected, indexes = 0, []
    for token in tokens:
        indexes.append(expected)
        expected += token["count"]
    return indexes


async def test_a_redis_outage_does_not_eject_the_triton_replica(redis_and_gateway) -> None:
    redis, _, gateway_url = redis_and_gateway
    async with httpx.AsyncClient(headers=AUTH, base_url=gateway_url, timeout=60) as client:
        before = (await client.get("/admin/replicas")).json()["replicas"]
        ids = [await submit(client, STREAM) for _ in range(4)]
        await asyncio.sleep(0.5)
        await _kill_and_restart(redis, down_s=1.0)
        records = await wait_all(client, ids, timeout=120)
        after = (await client.get("/admin/replicas")).json()["replicas"]
    assert {r["status"] for r in records} == {"succeeded"}
    # Never ejected, so never admitted again: the same generation, and no error recorded.
    assert [(r["url"], r["generation"], r["healthy"]) for r in after] == [
        (r["url"], r["generation"], True) for r in before
    ]


async def _follow(client: httpx.AsyncClient, request_id: str, started: asyncio.Event) -> list[str]:
    """One SSE connection, never resumed: the kinds of the events it gets until it ends."""
    kinds: list[str] = []
    async with client.stream("GET", f"/results/{request_id}/events") as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if line.startswith("event:"):
                kinds.append(line.partition(":")[2].strip())
                started.set()
    return kinds


async def test_an_sse_client_without_resume_logic_keeps_its_stream_through_a_redis_restart(redis_and_gateway) -> None:
    redis, _, gateway_url = redis_and_gateway
    async with httpx.AsyncClient(headers=AUTH, base_url=gateway_url, timeout=120) as client:
        ahead = [await submit(client, STREAM) for _ in range(40)]
        followed = await submit(client, {**STREAM, "inputs": {"text_input": "the last one", "max_tokens": 10}})
        started = asyncio.Event()
        reading = asyncio.create_task(_follow(client, followed, started))
        await asyncio.wait_for(started.wait(), timeout=60)  # its stream is open: it has its first event
        # 40 streams of 3 s ahead of it, 32 at a time in this gateway: it waits its turn.
        assert (await client.get(f"/results/{followed}")).json()["status"] == "queued"
        await _kill_and_restart(redis, down_s=1.5)  # its stream reads its place in line meanwhile
        kinds = await asyncio.wait_for(reading, timeout=120)
        await wait_all(client, ahead, timeout=120)
    assert kinds[-1] == "completed", kinds
    assert "error" not in kinds
