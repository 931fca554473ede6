"""A write on a Redis connection that another task closed meanwhile fails as a connection
error, which redis-py's retry and every loop of the gateway's (REDIS_OUTAGE) take as an
outage to retry, not as an error that ends the loop. redis-py 7 lets out what the closed
writer raised (redis/redis-py#4287): an AttributeError once the writer is gone, uvloop's
RuntimeError while it closes. The cluster client closes a node's connections, those in use
too, after a failure: a test stack's failover showed both (docs/deployment.md). A real
redis-server; the race is made by starting the write, then the close."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.common.redis import REDIS_OUTAGE, RedisClients, connect
from gateway.protocol.redis_keys import Shard
from tests.conftest import lone_redis


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "connections-redis") as url:
        yield url


async def write_while_closed(connection: Any, *, wait_closed: bool) -> BaseException | None:
    """What a PING written on `connection` raises when another task closes the connection
    under it. wait_closed=False: the write starts, then the close removes the writer
    before the write reaches it (the gateway's writes go out in the writer's own task, so
    the write waits where one can: its health check's round trip, made here a turn of the
    loop). wait_closed=True: the close starts first and waits for the socket to close, and
    the write comes meanwhile, to a writer that is closing."""
    await connection.connect()

    async def health_check() -> None:
        await asyncio.sleep(0)  # the close runs meanwhile

    connection.check_health = health_check
    if wait_closed:
        close = asyncio.create_task(connection.disconnect())
        write = asyncio.create_task(connection.send_command("PING"))
    else:
        write = asyncio.create_task(connection.send_command("PING"))
        close = asyncio.create_task(connection.disconnect(nowait=True))
    written, _ = await asyncio.gather(write, close, return_exceptions=True)
    return written if isinstance(written, BaseException) else None


async def test_a_write_whose_writer_another_task_removed_is_a_connection_error(redis_url: str) -> None:
    client = connect(redis_url, timeout_s=2, max_connections=4)
    try:
        failed = await write_while_closed(client.connection_pool.make_connection(), wait_closed=False)
        assert isinstance(failed, RedisConnectionError), repr(failed)
        assert isinstance(failed, REDIS_OUTAGE)
        assert await client.ping()  # the client goes on with a new connection
    finally:
        await client.aclose()


def test_a_write_on_a_closing_uvloop_transport_is_a_connection_error(redis_url: str) -> None:
    """The gateway runs on uvloop, whose closing transport refuses a write with RuntimeError."""

    async def race() -> BaseException | None:
        client = connect(redis_url, timeout_s=2, max_connections=4)
        try:
            return await write_while_closed(client.connection_pool.make_connection(), wait_closed=True)
        finally:
            await client.aclose()

    failed = uvloop.run(race())
    assert isinstance(failed, RedisConnectionError), repr(failed)


async def test_the_blocking_readers_connection_is_guarded_too(redis_url: str) -> None:
    clients = RedisClients.open(url=redis_url, cluster_nodes=[], timeout_s=2, max_connections=4)
    reader = await clients.reader(Shard(0))
    try:
        failed = await write_while_closed(reader.connection_pool.make_connection(), wait_closed=False)
        assert isinstance(failed, RedisConnectionError), repr(failed)
    finally:
        await reader.aclose()
        await clients.aclose()
