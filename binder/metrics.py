"""Prometheus metrics of one binder process (GET /metrics).

The lag of the `results` streams (summed over the shards) is the binders' group's, the
same whichever binder is asked: take max() over binders, not sum(). It is read from
Redis when scraped, and so is the number of entries in the results dead-letter streams
(binder_results_dead_letters, the same for every binder); binder_results_dead_lettered
counts the entries this binder put there, by reason."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from gateway.protocol.redis_keys import BINDER_GROUP, Shard

log = logging.getLogger(__name__)

# Redis before 7.0 reports no lag: count the undelivered entries then, up to this many.
LAG_COUNT_LIMIT = 10_000
COUNT_AFTER = """
return #redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])
"""


class _StoredTotal(Collector):
    def __init__(self, stored: Callable[[], int], dead_lettered: Callable[[], dict[str, int]]) -> None:
        self.stored = stored
        self.dead_lettered = dead_lettered

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("binder_results_stored", "Results this binder stored in MongoDB", value=self.stored())
        dead = CounterMetricFamily(
            "binder_results_dead_lettered",
            "Results entries this binder dead-lettered, by reason: unencodable or too_large (MongoDB can never "
            "store them: at once), redelivered (delivered too often without being stored)",
            labels=["reason"],
        )
        for reason, count in sorted(self.dead_lettered().items()):
            dead.add_metric([reason], count)
        yield dead


class BinderMetrics:
    def __init__(
        self,
        stored: Callable[[], int],
        registry: CollectorRegistry | None = None,
        dead_lettered: Callable[[], dict[str, int]] = dict,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.results_lag = Gauge(
            "binder_results_lag",
            "Entries of the results stream not yet delivered to any binder (the group's, not this binder's)",
            registry=r,
        )
        self.results_pending = Gauge(
            "binder_results_pending",
            "Entries of the results stream delivered to a binder but not yet stored (acknowledged)",
            registry=r,
        )
        self.webhook_outcomes = Counter(
            "binder_webhook_attempts",
            "Webhook attempts by outcome: delivered, retrying, failed (retries spent), gone (410), refused",
            ["outcome"],
            registry=r,
        )
        self.results_dead_letters = Gauge(
            "binder_results_dead_letters",
            "Entries in the results dead-letter streams (inspect and replay: POST /dead-letters/replay)",
            registry=r,
        )
        r.register(_StoredTotal(stored, dead_lettered))

    async def refresh(self, redis: Redis, shards: list[Shard]) -> None:
        """Read the group's lag and pending count; NaN when Redis cannot say (an outage)."""
        lag: float
        pending: float
        dead: float
        try:
            lag = pending = dead = 0
            for shard in shards:
                shard_lag, shard_pending = await results_backlog(redis, shard.results)
                lag += shard_lag
                pending += shard_pending
                dead += await redis.xlen(shard.results_dead)
        except RedisError as exc:
            log.warning("reading the results stream's lag failed: %s", exc)
            lag = pending = dead = math.nan
        self.results_lag.set(lag)
        self.results_pending.set(pending)
        self.results_dead_letters.set(dead)


async def results_backlog(redis: Redis, stream: str) -> tuple[int, int]:
    """(lag, pending) of the binders' group on a results stream: entries no binder has
    read yet, and entries read but not acknowledged (stored)."""
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError as exc:
        if "no such key" in str(exc).lower():
            return 0, 0  # nothing was ever published
        raise
    group = next((g for g in groups if g["name"] == BINDER_GROUP), None)
    if group is None:  # no binder has started yet: every entry waits
        return int(await redis.xlen(stream)), 0
    pending = int(group["pending"])
    lag = group.get("lag")
    if lag is None:  # Redis < 7, or 7 after deletions it cannot count past
        lag = await redis.eval(COUNT_AFTER, 1, stream, group["last-delivered-id"], LAG_COUNT_LIMIT)
    return int(lag), pending
