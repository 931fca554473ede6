"""The API key store on a MongoDB-wire server and a Redis of its own (no Triton, no
gateway): what a gateway's key cache serves while MongoDB is down. A key verified before
still works; a revoked key, here or on another gateway, does not come back; a flood of
random keys does not push out the keys of real callers; a known key or tenant is answered
at once while MongoDB hangs (the read goes on behind the callers), and callers of one key
share one read. One behaviour per test."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from pymongo import AsyncMongoClient, monitoring
from pymongo.errors import PyMongoError

from gateway.common.redis import RedisClients
from gateway.protocol.redis_keys import KEYS_CHANNEL
from gateway.server.tenants import keys
from gateway.server.tenants.config import TenantLimits, TenantStore
from gateway.server.tenants.keys import KeyStore, announcer, follow_key_changes
from gateway.stack.process import ManagedProcess, free_port
from gateway.stack.services import mongo_spec
from tests.conftest import lone_redis

DATABASE = "keys_test"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with lone_redis(tmp_path_factory, "keys-redis") as url:
        yield url


@dataclass
class Mongo:
    """A MongoDB-wire server of one test (the test stops it: the outage) and a client of it."""

    process: ManagedProcess
    client: AsyncMongoClient
    port: int

    def client_with(self, listener: monitoring.CommandListener | None = None) -> AsyncMongoClient:
        """Another client of the server, whose commands the listener sees; a read of a
        server that hangs waits for it (a minute), as a gateway's does."""
        return AsyncMongoClient(
            f"mongodb://127.0.0.1:{self.port}",
            tz_aware=True,
            event_listeners=[listener] if listener else [],
            serverSelectionTimeoutMS=500,
            connectTimeoutMS=500,
            socketTimeoutMS=60_000,
        )

    def store(self, **options) -> KeyStore:
        return KeyStore(self.client, DATABASE, **options)

    def stop(self) -> None:
        self.process.stop()

    @contextmanager
    def hung(self) -> Iterator[None]:
        """The server stopped with SIGSTOP: connected, it answers nothing (a MongoDB too busy
        to answer); reads wait for it without end."""
        assert self.process.pid is not None
        os.kill(self.process.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.process.pid, signal.SIGCONT)


class FindCounter(monitoring.CommandListener):
    """Counts the `find` commands a client sends and those that ended (answered or failed),
    through MongoDB's own command monitoring."""

    def __init__(self, on_reply=None) -> None:
        self.finds = 0
        self.ended = 0
        self.on_reply = on_reply

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        if event.command_name == "find":
            self.finds += 1

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name == "find":
            self.ended += 1
            if self.on_reply is not None:
                self.on_reply()

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        if event.command_name == "find":
            self.ended += 1


@pytest.fixture
async def mongo_server(tmp_path: Path) -> AsyncIterator[Mongo]:
    port = free_port()
    process = ManagedProcess(mongo_spec(data_dir=tmp_path, host="127.0.0.1", port=port))
    process.start()
    process.wait_ready(time.monotonic() + 60)
    # Down, a call fails in half a second instead of waiting out the default 30 s.
    client: AsyncMongoClient = AsyncMongoClient(
        f"mongodb://127.0.0.1:{port}", tz_aware=True, serverSelectionTimeoutMS=500, connectTimeoutMS=500
    )
    try:
        yield Mongo(process, client, port)
    finally:
        await client.close()
        process.stop()


@pytest.fixture
async def redis_clients(redis_url: str) -> AsyncIterator[RedisClients]:
    clients = RedisClients.open(url=redis_url, cluster_nodes=[], timeout_s=2.0, max_connections=8)
    yield clients
    await clients.aclose()


async def verified(store: KeyStore, token: str) -> str | None:
    """The id of the key the token verifies as; None when it is refused, as unknown or
    revoked or because it cannot be checked now (MongoDB down and the key not cached: the
    gateway answers 503)."""
    try:
        info = await store.verify(token)
    except PyMongoError:
        return None
    return info.key_id if info is not None else None


async def test_a_cached_key_still_verifies_while_mongodb_is_down(mongo_server: Mongo) -> None:
    store = mongo_server.store(cache_s=0)  # every verification asks MongoDB first
    info, token = await store.create("tenant-a")
    assert await verified(store, token) == info.key_id
    mongo_server.stop()
    assert await verified(store, token) == info.key_id


async def test_a_key_revoked_here_does_not_come_back_while_mongodb_is_down(mongo_server: Mongo) -> None:
    store = mongo_server.store(cache_s=0)
    info, token = await store.create("tenant-a")
    assert await verified(store, token) == info.key_id  # cached
    assert await store.revoke(info.key_id)
    mongo_server.stop()
    assert await verified(store, token) is None


async def test_a_key_revoked_on_another_gateway_does_not_come_back_while_mongodb_is_down(
    mongo_server: Mongo, redis_clients: RedisClients
) -> None:
    gateway = mongo_server.store(cache_s=0)
    follower = asyncio.create_task(follow_key_changes(gateway, redis_clients))
    try:
        deadline = time.monotonic() + 10
        while (await redis_clients.main.pubsub_numsub(KEYS_CHANNEL))[0][1] == 0:
            assert time.monotonic() < deadline, "the gateway never subscribed to key changes"
            await asyncio.sleep(0.05)
        admin = mongo_server.store(cache_s=0, announce=announcer(redis_clients))  # `gateway keys revoke`
        info, token = await admin.create("tenant-a")
        assert await verified(gateway, token) == info.key_id  # cached by the gateway
        assert await admin.revoke(info.key_id)
        mongo_server.stop()
        deadline = time.monotonic() + 10
        while await verified(gateway, token) is not None:
            assert time.monotonic() < deadline, "the revoked key is still served from the gateway's cache"
            await asyncio.sleep(0.05)
    finally:
        follower.cancel()
        await asyncio.gather(follower, return_exceptions=True)


async def test_a_flood_of_random_keys_does_not_push_out_a_valid_one(
    mongo_server: Mongo, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small bounds, so the flood stays quick: it outnumbers either cache, and both together.
    monkeypatch.setattr(keys, "MAX_CACHED_KEYS", 50)
    monkeypatch.setattr(keys, "MAX_CACHED_MISSES", 50)
    store = mongo_server.store(cache_s=600)
    info, token = await store.create("tenant-a")
    assert await verified(store, token) == info.key_id
    flood = [f"{keys.PREFIX}{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}" for _ in range(3 * 50)]
    for random_key in flood:
        assert await verified(store, random_key) is None
    mongo_server.stop()
    assert await verified(store, token) == info.key_id
    # The flood did overflow the cache of misses: its first key was pushed out (MongoDB is
    # asked, and fails), its last is still answered from the cache.
    with pytest.raises(PyMongoError):
        await store.verify(flood[0])
    assert await store.verify(flood[-1]) is None


async def sent(counter: FindCounter, finds: int) -> None:
    deadline = time.monotonic() + 10
    while counter.finds < finds:
        assert time.monotonic() < deadline, f"{finds} reads were never sent"
        await asyncio.sleep(0.01)


async def answered_while_hung(
    mongo: Mongo, counter: FindCounter, read: Callable[[], Awaitable[object]], expected: object
) -> None:
    """While MongoDB hangs, read() answers `expected` from the cache, the read that
    refreshes it sent behind it, and none of the answers waits for that read."""
    with mongo.hung():
        assert await read() == expected
        await sent(counter, 2)  # the read behind it
        for _ in range(3):
            assert await read() == expected
        assert counter.ended == 1, "the answers waited for MongoDB"


async def test_a_known_key_verifies_at_once_while_mongodb_hangs(mongo_server: Mongo) -> None:
    counter = FindCounter()
    client = mongo_server.client_with(counter)
    try:
        store = KeyStore(client, DATABASE, cache_s=0)  # every verification is old enough to be read again
        info, token = await store.create("tenant-a")
        assert await verified(store, token) == info.key_id
        await answered_while_hung(mongo_server, counter, lambda: verified(store, token), info.key_id)
    finally:
        await client.close()


async def test_a_known_tenants_settings_are_answered_at_once_while_mongodb_hangs(mongo_server: Mongo) -> None:
    counter = FindCounter()
    client = mongo_server.client_with(counter)
    try:
        tenants = TenantStore(client, DATABASE, TenantLimits(), cache_s=0)
        await tenants.update("tenant-a", {"weight": 3.0})

        async def weight() -> float:
            return (await tenants.get("tenant-a")).weight

        await answered_while_hung(mongo_server, counter, weight, 3.0)
    finally:
        await client.close()


async def test_callers_of_one_key_share_one_read(mongo_server: Mongo) -> None:
    counter = FindCounter()
    client = mongo_server.client_with(counter)
    try:
        store = KeyStore(client, DATABASE, cache_s=600)
        info, token = await store.create("tenant-a")
        answers = await asyncio.gather(*(verified(store, token) for _ in range(20)))
        assert answers == [info.key_id] * 20
        assert counter.finds == 1
    finally:
        await client.close()


async def test_a_known_key_is_read_again_behind_its_callers(mongo_server: Mongo) -> None:
    store = mongo_server.store(cache_s=0)
    info, token = await store.create("tenant-a")
    assert await verified(store, token) == info.key_id
    # Revoked in MongoDB without any announcement (a gateway that missed it): a read behind
    # the callers finds it, and the key stops working.
    await store.collection.update_one({"_id": info.key_id}, {"$set": {"revoked": True}})
    deadline = time.monotonic() + 10
    while await verified(store, token) is not None:
        assert time.monotonic() < deadline, "the cached key was never read again"
        await asyncio.sleep(0.05)


async def test_a_verification_in_flight_across_a_revocation_does_not_bring_the_key_back(mongo_server: Mongo) -> None:
    stores: list[KeyStore] = []
    # The revocation reaches the gateway between MongoDB's answer (the key still valid) and
    # the end of the verification that asked for it.
    counter = FindCounter(on_reply=lambda: stores[0].forget(info.key_id))
    client = mongo_server.client_with(counter)
    try:
        admin = mongo_server.store(cache_s=0)
        info, token = await admin.create("tenant-a")
        stores.append(KeyStore(client, DATABASE, cache_s=600))
        assert await verified(stores[0], token) == info.key_id  # valid when MongoDB answered
        assert counter.finds == 1
        await admin.revoke(info.key_id)
        mongo_server.stop()
        # Not cached: the next verification asks MongoDB (down), so the key is refused.
        assert await verified(stores[0], token) is None
        assert counter.finds == 2
    finally:
        await client.close()
