"""Redis clients with bounded pools and socket timeouts: a Redis that stops answering
fails a call instead of hanging it.

One Redis (REDIS_URL) or a Redis Cluster (REDIS_CLUSTER_NODES), behind one interface:
- `main`: commands and scripts (redis-py's asyncio client, or its RedisCluster client,
  which sends each command to the node holding its keys' slot);
- `pubsub()`: a client for SUBSCRIBE (in a cluster, any node: PUBLISH reaches them all);
- `reader(shard)`: one connection to the node holding a shard, for blocking reads
  (XREAD BLOCK), whose timeout exceeds the longest block.

Connection errors are retried a few times with backoff (the asyncio Retry class, on the
asyncio clients): every script is idempotent, so a command replayed after a lost reply
changes nothing more."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from redis.asyncio import BlockingConnectionPool, Redis, RedisCluster
from redis.asyncio.client import PubSub
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.protocol.redis_keys import Shard

# The longest BLOCK any reader asks for; blocking clients wait this much longer.
MAX_BLOCK_MS = 2000

REDIS_OUTAGE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


def _retry() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 3)


def connect(url: str, *, timeout_s: float, max_connections: int, blocking: bool = False) -> Redis:
    """A client whose commands fail after timeout_s (plus the block time for blocking
    readers) and whose pool holds at most max_connections (callers wait for one)."""
    socket_timeout = timeout_s + (MAX_BLOCK_MS / 1000 if blocking else 0)
    pool = BlockingConnectionPool.from_url(
        url,
        decode_responses=True,
        max_connections=max_connections,
        timeout=timeout_s,  # waiting for a free connection
        socket_timeout=socket_timeout,
        socket_connect_timeout=min(timeout_s, 2.0),
        health_check_interval=30,
        retry=_retry(),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return Redis.from_pool(pool)  # closing the client closes its pool


def _node(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host or "127.0.0.1", int(port)


@dataclass
class RedisClients:
    """The Redis clients of one process (see the module docstring)."""

    main: Any  # Redis | RedisCluster (typed loosely: their command sets differ only in routing)
    url: str = ""
    cluster: bool = False
    timeout_s: float = 5.0

    @classmethod
    def open(cls, *, url: str, cluster_nodes: list[str], timeout_s: float, max_connections: int) -> RedisClients:
        if not cluster_nodes:
            main = connect(url, timeout_s=timeout_s, max_connections=max_connections)
            return cls(main=main, url=url, timeout_s=timeout_s)
        main = RedisCluster(
            startup_nodes=[ClusterNode(*_node(n)) for n in cluster_nodes],
            decode_responses=True,
            socket_timeout=timeout_s,
            socket_connect_timeout=min(timeout_s, 2.0),
            max_connections=max_connections,
            retry=_retry(),
            retry_on_error=[RedisConnectionError, RedisTimeoutError],
            # A failover moves slots: find the new owner and try again.
            cluster_error_retry_attempts=6,
        )
        return cls(main=main, cluster=True, timeout_s=timeout_s)

    def _plain(self, host: str, port: int, *, blocking: bool) -> Redis:
        return Redis(
            host=host,
            port=port,
            decode_responses=True,
            socket_timeout=self.timeout_s + (MAX_BLOCK_MS / 1000 if blocking else 0),
            socket_connect_timeout=min(self.timeout_s, 2.0),
            single_connection_client=blocking,
        )

    async def _node_of(self, key: str | None = None) -> tuple[str, int]:
        if self.main.get_nodes() == []:
            await self.main.initialize()
        node = random.choice(self.main.get_primaries()) if key is None else self.main.get_node_from_key(key)
        return node.host, node.port

    @asynccontextmanager
    async def subscription(self, *channels: str) -> AsyncIterator[PubSub]:
        """A pub/sub connection subscribed to the channels (in a cluster, on any node:
        PUBLISH reaches every node)."""
        client = self.main
        if self.cluster:
            client = self._plain(*await self._node_of(), blocking=False)
        pubsub = client.pubsub()
        try:
            await pubsub.subscribe(*channels)
            yield pubsub
        finally:
            await pubsub.aclose()
            if client is not self.main:
                await client.aclose()

    async def reader(self, shard: Shard) -> Redis:
        """One connection to the Redis holding `shard`, for blocking reads."""
        if not self.cluster:
            return Redis.from_url(
                self.url,
                decode_responses=True,
                socket_timeout=self.timeout_s + MAX_BLOCK_MS / 1000,
                socket_connect_timeout=min(self.timeout_s, 2.0),
                single_connection_client=True,
            )
        host, port = await self._node_of(shard.backlog)
        return self._plain(host, port, blocking=True)

    async def aclose(self) -> None:
        await self.main.aclose()


__all__ = ["MAX_BLOCK_MS", "REDIS_OUTAGE", "RedisClients", "RedisError", "connect"]
