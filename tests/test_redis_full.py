"""A Redis at its maxmemory (noeviction, as the stack runs it) refuses new work: the
gateway answers 503 redis_full, whether the refused write was a command of its own or one
inside a script; an unreachable Redis stays 503 redis_unavailable. A real redis-server."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from gateway.protocol import new_request_id
from gateway.server.api.errors import ErrorRenderer
from gateway.server.queue.jobs import Admission, JobStore, NewRequest
from tests.conftest import lone_redis

OPEN = Admission(max_backlog=10_000, max_batch_backlog=10_000, max_bytes=10**9, reserve=4)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "full-redis") as url:
        yield url


@pytest.fixture
async def full(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    """A client of a Redis whose every write is refused: maxmemory below what it uses."""
    client = aioredis.from_url(redis_server, decode_responses=True)
    await client.flushdb()
    await client.config_set("maxmemory-policy", "noeviction")
    await client.config_set("maxmemory", 1)
    yield client
    await client.config_set("maxmemory", 0)
    await client.aclose()


def _answer(exc: Exception) -> tuple[int, str]:
    response = ErrorRenderer().of("/infer", "POST", exc)
    assert response is not None
    return response.status_code, json.loads(bytes(response.body))["error"]["code"]


async def _refusal(write) -> RedisError:
    with pytest.raises(RedisError) as refused:
        await write
    return refused.value


async def test_a_submission_refused_inside_its_script_is_redis_full(full: aioredis.Redis) -> None:
    now = time.time()
    store = JobStore(full, idempotency_ttl_s=60, lease_ms=10_000)
    submit = store.submit(
        [NewRequest(new_request_id(now), {"inputs": {}}, now, now + 60)],
        model="m",
        tenant="t",
        band="normal",
        admission=OPEN,
    )
    assert _answer(await _refusal(submit)) == (503, "redis_full")


async def test_a_command_refused_at_maxmemory_is_redis_full(full: aioredis.Redis) -> None:
    assert _answer(await _refusal(full.set("key", "value"))) == (503, "redis_full")


def test_a_redis_out_of_reach_is_redis_unavailable() -> None:
    assert _answer(RedisConnectionError("Connection refused")) == (503, "redis_unavailable")
