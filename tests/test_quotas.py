"""Tenants' rate limits (gateway/server/tenants/quotas.py) against a real Redis: on one
Redis the `limits` library's counters travel through the gateway's group commit, so the
admissions of a loop turn share its pipeline instead of a connection and round trips each;
the counters are the library's own, read alike by its plain storage; a Redis that stops
answering fails an admission instead of holding it.

What a tenant sees of the limits (429s, headers, tokens charged) is specified against the
whole stack in tests/test_tenants.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.common.redis import GroupCommit, connect
from gateway.server.errors import Busy, InvalidRequest
from gateway.server.tenants.config import TenantConfig, TenantLimits
from gateway.server.tenants.quotas import Quotas
from tests.conftest import lone_redis

GROUP_CLIENT = "quota-group"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "quota-redis") as url:
        yield url


@pytest.fixture
async def group_client(redis_url: str) -> AsyncIterator[Redis]:
    client = connect(f"{redis_url}?client_name={GROUP_CLIENT}", timeout_s=0.5, max_connections=64)
    yield client
    await client.aclose()


@pytest.fixture
async def inspector(redis_url: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url, decode_responses=True, client_name="quota-inspector")
    yield client
    await client.execute_command("CLIENT", "UNPAUSE")
    await client.aclose()


def tenant(name: str, rpm: int = 0, tpm: int = 0) -> TenantConfig:
    return TenantConfig(tenant=name, limits=TenantLimits(requests_per_minute=rpm, tokens_per_minute=tpm))


async def other_connections(inspector: Redis) -> int:
    """Connections Redis has from anything but the group commit and the inspector."""
    names = [c.get("name") for c in await inspector.client_list()]
    return sum(1 for name in names if name not in (GROUP_CLIENT, "quota-inspector"))


async def test_the_admissions_of_one_turn_travel_in_the_group_commits_pipeline(
    redis_url: str, group_client: Redis, inspector: Redis
) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    configs = [tenant(f"grouped-{i}", rpm=1000, tpm=100_000) for i in range(40)]
    headers = await asyncio.gather(*(quotas.admit(config, 12) for config in configs))
    assert all(h["x-ratelimit-remaining-requests"] == "999" for h in headers)
    assert all(h["x-ratelimit-remaining-tokens"] == str(100_000 - 12) for h in headers)
    # The library's own client opened nothing: its 160 calls went through the group's
    # pipelines (a connection for each pipeline in flight at once).
    assert await other_connections(inspector) == 0
    assert sum(1 for c in await inspector.client_list() if c.get("name") == GROUP_CLIENT) <= 3


async def test_the_grouped_counters_are_the_librarys_own(redis_url: str, group_client: Redis) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    plain = SlidingWindowCounterRateLimiter(RedisStorage(redis_url.replace("redis://", "async+redis://", 1)))
    item = RateLimitItemPerMinute(10)
    config = tenant("shared-counter", rpm=10)
    for _ in range(3):
        await quotas.admit(config, 1)
    assert (await plain.get_window_stats(item, "rpm", "shared-counter")).remaining == 7
    assert await plain.hit(item, "rpm", "shared-counter", cost=2)
    headers = await quotas.admit(config, 1)
    assert headers["x-ratelimit-remaining-requests"] == "4"


async def test_a_request_refused_by_its_rate_is_not_charged_tokens(redis_url: str, group_client: Redis) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    config = tenant("refused-rate", rpm=2, tpm=1000)
    await quotas.admit(config, 100)
    await quotas.admit(config, 100)
    with pytest.raises(Busy) as refused:
        await quotas.admit(config, 100)
    assert refused.value.code == "rate_limited"
    plain = SlidingWindowCounterRateLimiter(RedisStorage(redis_url.replace("redis://", "async+redis://", 1)))
    tokens = await plain.get_window_stats(RateLimitItemPerMinute(1000), "tpm", "refused-rate")
    assert tokens.remaining == 800


async def test_a_prompt_over_the_whole_tokens_per_minute_is_refused_as_invalid_and_counts_nothing(
    redis_url: str, group_client: Redis
) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    config = tenant("too-large", rpm=10, tpm=100)
    with pytest.raises(InvalidRequest) as refused:
        await quotas.admit(config, 101)
    assert refused.value.code == "prompt_over_token_limit"
    headers = await quotas.admit(config, 100)  # exactly the limit fits
    assert headers["x-ratelimit-remaining-requests"] == "9" and headers["x-ratelimit-remaining-tokens"] == "0"


async def test_admissions_of_one_turn_are_each_counted_against_a_shared_limit(
    redis_url: str, group_client: Redis
) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    config = tenant("one-turn-limit", rpm=5)
    answers = await asyncio.gather(*(quotas.admit(config, 1) for _ in range(8)), return_exceptions=True)
    assert sum(1 for a in answers if isinstance(a, dict)) == 5
    assert all(a.code == "rate_limited" for a in answers if isinstance(a, Busy))


async def test_an_admission_fails_when_redis_stops_answering(
    redis_url: str, group_client: Redis, inspector: Redis
) -> None:
    quotas = Quotas(redis_url, group=GroupCommit(group_client))
    config = tenant("paused-redis", rpm=100, tpm=1000)
    await quotas.admit(config, 1)  # connected before the pause
    await inspector.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    with pytest.raises((RedisTimeoutError, RedisConnectionError)):
        async with asyncio.timeout(30):  # the guard of this test; the client gives up after ~0.5 s a try
            await quotas.admit(config, 1)


async def test_without_the_group_commit_an_admission_fails_when_redis_stops_answering(
    redis_url: str, inspector: Redis
) -> None:
    quotas = Quotas(redis_url, timeout_s=0.5)
    config = tenant("paused-redis-plain", rpm=100)
    await quotas.admit(config, 1)
    await inspector.execute_command("CLIENT", "PAUSE", 60_000, "WRITE")
    with pytest.raises((RedisTimeoutError, RedisConnectionError)):
        async with asyncio.timeout(30):
            await quotas.admit(config, 1)
