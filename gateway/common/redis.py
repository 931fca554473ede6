"""Redis clients with bounded pools and socket timeouts: a Redis that stops answering
fails a call instead of hanging it. Blocking reads (XREAD BLOCK) use their own client,
whose timeout exceeds the longest block."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

# The longest BLOCK any reader asks for; blocking clients wait this much longer.
MAX_BLOCK_MS = 2000

REDIS_OUTAGE = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


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
        # Retries are for connection errors only; every script is idempotent, so a
        # command replayed after a lost reply changes nothing.
        retry=Retry(ExponentialWithJitterBackoff(base=0.05, cap=0.5), 2),
        retry_on_error=[RedisConnectionError],
    )
    return Redis.from_pool(pool)  # closing the client closes its pool


__all__ = ["MAX_BLOCK_MS", "REDIS_OUTAGE", "RedisError", "connect"]
