"""A stored quota's reservation (gateway.server.tenants.reservations) on its own Redis:
resized while it is held, a growth checked against the quota beside the other
reservations, a shrink always taken; released once, as a mark of its last size."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
import redis.asyncio as aioredis

from gateway.server.tenants.reservations import Over, Reservation, now_ms, reserve

KEY = "uploads:reserved:{tenant-r}"


@pytest_asyncio.fixture
async def client(redis_server: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(redis_server)
    await client.delete(KEY)
    yield client
    await client.aclose()


async def held(client: aioredis.Redis, size: int, *, kept_bytes: int = 0, most: int = 100) -> Reservation:
    reserved = await reserve(
        client, KEY, kept=0, kept_bytes=kept_bytes, counted_at_ms=now_ms(), size=size, max_count=0, max_bytes=most
    )
    assert isinstance(reserved, Reservation), reserved
    return reserved


async def test_a_reservation_grows_while_what_it_grows_to_fits_beside_the_others(client) -> None:
    first, second = await held(client, 30), await held(client, 30)
    assert await first.resize(70) is None  # 70 + 30 of 100
    assert await second.resize(31) == Over("bytes", 70)
    assert second.size == 30
    assert (await client.hget(KEY, second.id)).startswith(b"30:")


async def test_a_reservation_shrinks_to_what_it_holds_now(client) -> None:
    reservation = await held(client, 60, kept_bytes=30)
    assert await reservation.resize(10) is None
    assert reservation.size == 10 and (await client.hget(KEY, reservation.id)).startswith(b"10:")


async def test_a_reservation_is_released_once_as_a_mark_of_its_last_size(client) -> None:
    reservation = await held(client, 40)
    assert await reservation.resize(25) is None
    await reservation.release()
    mark = await client.hget(KEY, reservation.id)
    assert mark.startswith(b"R25:"), mark
    await reservation.release()  # a second release writes nothing
    assert await client.hget(KEY, reservation.id) == mark
    assert await reservation.resize(30) == Over("released", 0)  # and no resize brings it back
    assert await client.hget(KEY, reservation.id) == mark
