"""Per-tenant rate limits over Redis with the `limits` library (sliding-window counters):
requests per minute, counted at admission, and tokens per minute: a request's prompt
tokens are charged at admission (it is refused if they do not fit the window), its
completion tokens when they are known (settled at the end). Answers carry OpenAI's
x-ratelimit-* headers; a refusal is Busy (429 with Retry-After)."""

from __future__ import annotations

import math
import time
from urllib.parse import urlsplit

from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisClusterStorage, RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from gateway.server.errors import Busy
from gateway.server.tenants.config import TenantConfig


def _reset(reset_time: float) -> str:
    seconds = max(0.0, reset_time - time.time())
    return f"{seconds:.3f}s" if seconds < 60 else f"{int(seconds // 60)}m{seconds % 60:.0f}s"


class Quotas:
    def __init__(self, redis_url: str, cluster_nodes: list[str] | None = None) -> None:
        """On a Redis Cluster (cluster_nodes: host:port of any of its nodes) the counters
        are spread over its slots: `limits` tags both windows of a counter alike."""
        storage: RedisStorage
        if cluster_nodes:  # REDIS_URL's credentials, the cluster's nodes
            login = urlsplit(redis_url).netloc.rpartition("@")[0]
            uri = "async+redis+cluster://" + (f"{login}@" if login else "") + ",".join(cluster_nodes)
            storage = RedisClusterStorage(uri, implementation="redispy")
        else:
            storage = RedisStorage(redis_url.replace("redis://", "async+redis://", 1), implementation="redispy")
        self.limiter = SlidingWindowCounterRateLimiter(storage)

    async def admit(self, config: TenantConfig, prompt_tokens: int) -> dict[str, str]:
        """Count one request and charge its prompt tokens; the rate-limit headers, or
        Busy when over a limit (then nothing is charged for tokens)."""
        limits = config.limits
        headers: dict[str, str] = {}
        if limits.requests_per_minute:
            item = RateLimitItemPerMinute(limits.requests_per_minute)
            allowed = await self.limiter.hit(item, "rpm", config.tenant)
            stats = await self.limiter.get_window_stats(item, "rpm", config.tenant)
            headers |= {
                "x-ratelimit-limit-requests": str(limits.requests_per_minute),
                "x-ratelimit-remaining-requests": str(max(0, stats.remaining)),
                "x-ratelimit-reset-requests": _reset(stats.reset_time),
            }
            if not allowed:
                raise self._refusal("rate_limited", "requests per minute", stats.reset_time, headers)
        if limits.tokens_per_minute:
            item = RateLimitItemPerMinute(limits.tokens_per_minute)
            allowed = await self.limiter.hit(item, "tpm", config.tenant, cost=max(1, prompt_tokens))
            stats = await self.limiter.get_window_stats(item, "tpm", config.tenant)
            headers |= {
                "x-ratelimit-limit-tokens": str(limits.tokens_per_minute),
                "x-ratelimit-remaining-tokens": str(max(0, stats.remaining)),
                "x-ratelimit-reset-tokens": _reset(stats.reset_time),
            }
            if not allowed:
                raise self._refusal("token_rate_limited", "tokens per minute", stats.reset_time, headers)
        return headers

    async def used_tokens(self, config: TenantConfig, tokens: int) -> None:
        """Charge the tokens a request used beyond what admission charged (its completion)."""
        if config.limits.tokens_per_minute and tokens > 0:
            item = RateLimitItemPerMinute(config.limits.tokens_per_minute)
            # hit() refuses (and counts nothing) once the window is full; what was used is
            # used all the same, so count what still fits.
            if not await self.limiter.hit(item, "tpm", config.tenant, cost=tokens):
                stats = await self.limiter.get_window_stats(item, "tpm", config.tenant)
                if stats.remaining > 0:
                    await self.limiter.hit(item, "tpm", config.tenant, cost=stats.remaining)

    @staticmethod
    def _refusal(code: str, what: str, reset_time: float, headers: dict[str, str]) -> Busy:
        retry = max(1, math.ceil(reset_time - time.time()))
        return Busy(code, f"over this tenant's {what}; retry in {retry}s", retry_after_s=retry, headers=headers)
