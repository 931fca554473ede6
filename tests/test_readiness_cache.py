"""/readyz is public: however often it is called, the gateway checks Redis (and MongoDB)
at most about once a second a process, the calls meanwhile sharing the last check."""

from __future__ import annotations

import asyncio

import httpx


async def _pings(redis) -> int:
    stats = await redis.info("commandstats")
    return int(stats.get("cmdstat_ping", {}).get("calls", 0))


async def test_readyz_pings_redis_at_most_once_a_second_however_often_it_is_called(stack, redis) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as client:
        before = await _pings(redis)
        for _ in range(4):  # 4 rounds of 25 at once: 100 calls, within a few seconds
            answers = await asyncio.gather(*(client.get("/readyz") for _ in range(25)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
        pinged = await _pings(redis) - before
    # Uncached that is 100 pings; cached, one a second a process (and what else pings).
    assert pinged < 30, pinged
