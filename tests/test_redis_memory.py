"""A finished request costs Redis nothing for long: once the binder has stored it, its
hash, its events and its results entry go RESULTS_KEEP_S later (1 s here), and every
read is answered from MongoDB after that, with the same record."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from gateway.protocol.redis_keys import shard_of
from tests.conftest import AUTH
from tests.gateway_calls import llm_body, read_events, submit, wait_result

MEMORY_DB = 14


@pytest.fixture(scope="module")
def short_keep(stack) -> Iterator[str]:
    env = {"REDIS_URL": stack.redis_db_url(MEMORY_DB)}
    gateway, url = stack.start_gateway("gateway-memory", **env)
    binder, _ = stack.start_binder("binder-memory", RESULTS_KEEP_S="1", **env)
    yield url
    stack.stop(binder)
    stack.stop(gateway)


@pytest_asyncio.fixture
async def db(stack) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(stack.redis_db_url(MEMORY_DB), decode_responses=True)
    yield client
    await client.aclose()


async def _kept(db: aioredis.Redis, request_id: str) -> list[str]:
    """What Redis still holds of the request: its own keys, and its results entry."""
    shard = shard_of(request_id)
    kept = [key for key in (shard.request(request_id), shard.events(request_id)) if await db.exists(key)]
    entries = await db.xrange(shard.results)
    return kept + [f"results entry {entry}" for entry, fields in entries if fields.get("id") == request_id]


async def _until_gone(db: aioredis.Redis, request_id: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while kept := await _kept(db, request_id):
        assert time.monotonic() < deadline, f"still in Redis after {timeout}s: {kept}"
        await asyncio.sleep(0.2)


async def test_a_stored_result_leaves_nothing_of_its_own_in_redis(short_keep, db) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=short_keep, timeout=60) as client:
        request_id = await submit(client, {"model": "clip_text", "inputs": {"text": "kept briefly"}})
        assert await _kept(db, request_id), "the request is not where this test looks"
        finished = await wait_result(client, request_id)
        await _until_gone(db, request_id)
        stored = (await client.get(f"/results/{request_id}")).json()
    assert stored["stored"] is True
    assert stored["outputs"] == finished["outputs"]


async def test_a_streamed_generation_replays_from_mongodb_once_its_events_are_gone(short_keep, db) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=short_keep, timeout=60) as client:
        request_id = await submit(client, llm_body("let it go", 20, model="llm_synthetic", stream=True))
        live = await read_events(client, request_id)
        await _until_gone(db, request_id)
        replayed = await read_events(client, request_id)
    tokens = "".join(json.loads(e["data"])["text_output"] for e in live if e["event"] == "token")
    assert len(tokens) > 0
    assert [e["event"] for e in replayed] == ["completed"]
    assert json.loads(replayed[0]["data"])["outputs"]["text_output"] == tokens
