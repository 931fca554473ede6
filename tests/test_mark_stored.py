"""The binder's MARK_STORED script on a real Redis (binder/archive.py): a stored request's
hash says so, its hash and events stream (which FINISH leaves without an expiry) go
RESULTS_KEEP_S later, a hash that already expired is not made again, and all of it in
three commands a request."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import redis.asyncio as aioredis

from binder.archive import MARK_STORED
from tests.conftest import lone_redis

KEEP_S = 30


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "mark-stored-redis") as url:
        yield url


@pytest_asyncio.fixture
async def redis(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server, decode_responses=True)
    await client.flushdb()
    yield client
    await client.aclose()


async def finished(redis: aioredis.Redis, name: str) -> tuple[str, str]:
    """A finished request's hash and events stream, as FINISH leaves them: no expiry."""
    request, events = f"req:{name}", f"events:{name}"
    await redis.hset(request, mapping={"state": "succeeded"})
    await redis.xadd(events, {"event": "completed"})
    return request, events


async def commands(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(int(stat["calls"]) for name, stat in stats.items() if name != "cmdstat_info")


async def test_a_stored_request_is_marked_and_goes_after_the_keep_time(redis: aioredis.Redis) -> None:
    mark = redis.register_script(MARK_STORED)
    request, events = await finished(redis, "a")
    await mark(keys=[request, events], args=[KEEP_S])
    assert await redis.hget(request, "stored") == "1"
    assert 0 < await redis.ttl(request) <= KEEP_S
    assert 0 < await redis.ttl(events) <= KEEP_S


async def test_a_hash_that_expired_is_not_made_again(redis: aioredis.Redis) -> None:
    mark = redis.register_script(MARK_STORED)
    await mark(keys=["req:gone", "events:gone"], args=[KEEP_S])
    assert not await redis.exists("req:gone")


async def test_marking_costs_three_redis_commands_a_request(redis: aioredis.Redis) -> None:
    mark = redis.register_script(MARK_STORED)
    await mark(keys=list(await finished(redis, "warm")), args=[KEEP_S])  # (the script loaded)
    keys = [key for n in range(10) for key in await finished(redis, f"r{n}")]
    before = await commands(redis)
    await mark(keys=keys, args=[KEEP_S])
    assert await commands(redis) - before - 1 <= 3 * 10  # (one EVALSHA for the ten)
