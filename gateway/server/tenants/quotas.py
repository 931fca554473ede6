"""Per-tenant rate limits over Redis with the `limits` library (sliding-window counters):
requests per minute, counted at admission, and tokens per minute: a request's prompt
tokens are charged at admission (it is refused if they do not fit the window), its
completion tokens when they are known (settled at the end), and where admission could only
reserve an upper bound of the prompt (an embedding model that counts its texts' tokens
itself) what the model's count left of it is given back at the end. Answers carry OpenAI's
x-ratelimit-* headers; a refusal is Busy (429 with Retry-After).

On one Redis the counters' scripts (the library's own) go through the gateway's group
commit (GroupedStorage): the admissions of a loop turn share one pipeline with the other
script calls of that turn instead of a connection and round trip each, a hit and the read
of its window travel together (two round trips for a tenant with both limits, not four),
and a Redis that stops answering fails them after REDIS_TIMEOUT_S, as it fails the
gateway's other calls."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any
from urllib.parse import urlsplit

from limits import RateLimitItem, RateLimitItemPerMinute, WindowStats
from limits.aio.storage import RedisClusterStorage, RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from gateway.common.redis import REDIS_OUTAGE, GroupCommit
from gateway.server.errors import Busy, InvalidRequest
from gateway.server.tenants.config import TenantConfig

log = logging.getLogger(__name__)


def _reset(reset_time: float) -> str:
    seconds = max(0.0, reset_time - time.time())
    return f"{seconds:.3f}s" if seconds < 60 else f"{int(seconds // 60)}m{seconds % 60:.0f}s"


class GroupedStorage(RedisStorage):
    """`limits`' Redis storage whose sliding-window scripts (the library's own, with its
    keys) are sent through the gateway's group commit instead of its own connection: what
    the limiter does is unchanged, only how its calls travel."""

    def __init__(self, uri: str, group: GroupCommit, **options: Any) -> None:
        super().__init__(uri, implementation="redispy", **options)  # (its own client: unused here)
        self.group = group

    def _windows(self, key: str) -> list[str]:
        """The previous and current window's keys, as the library names them."""
        return [
            self.bridge.prefixed_key(self._previous_window_key(key)),
            self.bridge.prefixed_key(self._current_window_key(key)),
        ]

    async def acquire_sliding_window_entry(self, key: str, limit: int, expiry: int, amount: int = 1) -> bool:
        script = self.bridge.lua_acquire_sliding_window  # type: ignore[attr-defined]
        return bool(await self.group.call(script, self._windows(key), [limit, expiry, amount]))

    async def get_sliding_window(self, key: str, expiry: int) -> tuple[int, float, int, float]:
        script = self.bridge.lua_sliding_window  # type: ignore[attr-defined]
        window = await self.group.call(script, self._windows(key), [expiry])
        if not window:
            return 0, 0.0, 0, 0.0
        # As the library's bridge reads the reply: counts, and TTLs in ms.
        return (
            int(window[0] or 0),
            max(0, float(window[1] or 0)) / 1000,
            int(window[2] or 0),
            max(0, float(window[3] or 0)) / 1000,
        )


class Quotas:
    def __init__(
        self,
        redis_url: str,
        cluster_nodes: list[str] | None = None,
        group: GroupCommit | None = None,
        *,
        timeout_s: float = 5.0,
    ) -> None:
        """On a Redis Cluster (cluster_nodes: host:port of any of its nodes) the counters
        are spread over its slots: `limits` tags both windows of a counter alike. On one
        Redis with the group commit (`group`), the counters' calls go through it (and its
        client's timeouts); otherwise the library's own client fails a call after
        timeout_s, as the gateway's clients do."""
        storage: RedisStorage
        timeouts: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": min(timeout_s, 2.0)}
        if cluster_nodes:  # REDIS_URL's credentials, the cluster's nodes
            login = urlsplit(redis_url).netloc.rpartition("@")[0]
            uri = "async+redis+cluster://" + (f"{login}@" if login else "") + ",".join(cluster_nodes)
            storage = RedisClusterStorage(uri, implementation="redispy", **timeouts)
        elif group is not None:
            storage = GroupedStorage(redis_url.replace("redis://", "async+redis://", 1), group, **timeouts)
        else:
            uri = redis_url.replace("redis://", "async+redis://", 1)
            storage = RedisStorage(uri, implementation="redispy", **timeouts)
        self.limiter = SlidingWindowCounterRateLimiter(storage)

    async def admit(self, config: TenantConfig, prompt_tokens: int) -> dict[str, str]:
        """Count one request and charge its prompt tokens; the rate-limit headers, or
        Busy when over a limit (then nothing is charged for tokens). Prompt tokens
        beyond the whole tokens-per-minute limit are refused as invalid (nothing counted):
        no wait would let them in, so a 429's Retry-After would send the caller round in
        circles."""
        limits = config.effective
        if limits.tokens_per_minute and prompt_tokens > limits.tokens_per_minute:
            raise InvalidRequest(
                "prompt_over_token_limit",
                f"this call's {prompt_tokens} prompt tokens are more than its tenant's {limits.tokens_per_minute} "
                "tokens per minute: it can never be admitted; shorten it, or ask for a higher limit",
            )
        headers: dict[str, str] = {}
        windows = (  # (the limit, its counter, what it counts, this call's cost, the refusal's code)
            (limits.requests_per_minute, "rpm", "requests", 1, "rate_limited"),
            (limits.tokens_per_minute, "tpm", "tokens", max(1, prompt_tokens), "token_rate_limited"),
        )
        for limit, kind, unit, cost, code in windows:
            if not limit:
                continue
            allowed, stats = await self._hit(RateLimitItemPerMinute(limit), kind, config.tenant, cost)
            headers |= {
                f"x-ratelimit-limit-{unit}": str(limit),
                f"x-ratelimit-remaining-{unit}": str(max(0, stats.remaining)),
                f"x-ratelimit-reset-{unit}": _reset(stats.reset_time),
            }
            if not allowed:
                raise self._refusal(code, f"{unit} per minute", stats.reset_time, headers)
        return headers

    async def _hit(self, item: RateLimitItem, kind: str, tenant: str, cost: int) -> tuple[bool, WindowStats]:
        """Charge `cost` and read the window after it. On the group commit both go in one
        pipeline: calls made in one turn are sent in the order they were made (the
        gathered hit first), so the read sees the hit."""
        if isinstance(self.limiter.storage, GroupedStorage):
            allowed, stats = await asyncio.gather(
                self.limiter.hit(item, kind, tenant, cost=cost), self.limiter.get_window_stats(item, kind, tenant)
            )
            return allowed, stats
        allowed = await self.limiter.hit(item, kind, tenant, cost=cost)
        return allowed, await self.limiter.get_window_stats(item, kind, tenant)

    async def refund(self, config: TenantConfig, prompt_tokens: int) -> None:
        """Give back what `admit` charged for a call that was then not accepted (its backlog
        was full, too few replicas confirmed it): a refused call costs no quota. A negative
        hit of the library's own sliding-window script lowers the current window's count."""
        limits = config.effective
        charges = [(limits.requests_per_minute, "rpm", 1), (limits.tokens_per_minute, "tpm", max(1, prompt_tokens))]
        try:
            for limit, kind, cost in charges:
                if limit:
                    await self.limiter.hit(RateLimitItemPerMinute(limit), kind, config.tenant, cost=-cost)
        except REDIS_OUTAGE as exc:  # the refusal is answered all the same
            log.warning("quota refund for %s failed: %s", config.tenant, type(exc).__name__)

    async def used_tokens(self, config: TenantConfig, tokens: int) -> None:
        """Charge the tokens a request used beyond what admission charged (its completion)."""
        if config.effective.tokens_per_minute and tokens > 0:
            item = RateLimitItemPerMinute(config.effective.tokens_per_minute)
            # hit() refuses (and counts nothing) once the window is full; what was used is
            # used all the same, so count what still fits.
            if not await self.limiter.hit(item, "tpm", config.tenant, cost=tokens):
                stats = await self.limiter.get_window_stats(item, "tpm", config.tenant)
                if stats.remaining > 0:
                    await self.limiter.hit(item, "tpm", config.tenant, cost=stats.remaining)

    async def unreserve(self, config: TenantConfig, tokens: int) -> None:
        """Give back the part of admission's reservation a call did not use (it reserved an
        upper bound of the prompt's tokens and the model counted fewer): a negative hit, as
        refund's, so the window then holds what was used. (One given back after the window
        turned lowers the new window: the tenant has those tokens again a little early.)"""
        if config.effective.tokens_per_minute and tokens > 0:
            item = RateLimitItemPerMinute(config.effective.tokens_per_minute)
            await self.limiter.hit(item, "tpm", config.tenant, cost=-tokens)

    @staticmethod
    def _refusal(code: str, what: str, reset_time: float, headers: dict[str, str]) -> Busy:
        retry = max(1, math.ceil(reset_time - time.time()))
        return Busy(code, f"over this tenant's {what}; retry in {retry}s", retry_after_s=retry, headers=headers)
