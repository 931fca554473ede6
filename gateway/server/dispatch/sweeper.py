"""Housekeeping every gateway does (any may, all at once is harmless): put running
requests whose lease ran out (their dispatcher died) back in line, expire requests whose
deadline passed while they waited (or whose run stopped being renewed), and keep the
replica gauges (the backlog gauge is the dispatcher's: it reads the backlog anyway)."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis

from gateway.common.redis import REDIS_OUTAGE
from gateway.protocol import State
from gateway.protocol.records import replica_name
from gateway.server import spine
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

# Requests past their deadline a shard's sweep ends at most at once.
SWEEP_MOST = 200


class Sweeper:
    def __init__(
        self,
        redis: Redis,
        jobs: JobStore,
        pool: ReplicaPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.redis = redis
        self.jobs = jobs
        self.pool = pool
        self.settings = settings
        self.metrics = metrics

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            await self.sweep()

    async def sweep(self) -> None:
        for shard in self.jobs.shards:
            try:
                reclaimed = await spine.reclaim(self.jobs, shard)
            except REDIS_OUTAGE as exc:  # that shard's Redis is away: sweep the others
                log.warning("reclaiming in %s failed: %s", shard.prefix, type(exc).__name__)
                continue
            if reclaimed:
                log.info("%d running requests of %s lost their dispatcher; they start again", reclaimed, shard.prefix)
        await self.expire_overdue()
        for replica in self.pool.replicas:
            # Labelled as records name replicas: /metrics may be public, the addresses are
            # not (GET /admin/replicas maps names to addresses).
            name = replica_name(replica.url)
            self.metrics.replica_healthy.labels(name).set(1 if replica.healthy else 0)
            self.metrics.inflight.labels(name).set(replica.inflight)

    async def expire_overdue(self) -> None:
        """End the requests of each shard whose deadline passed: those due read in one round
        trip, those that ended meanwhile dropped from the deadlines set in one command, the
        rest expired together (their FINISHes share the group commit's calls)."""
        now = time.time()
        # Running requests get a grace period: their own dispatcher expires them first.
        grace = self.settings.claim_idle_ms / 1000
        for shard in self.jobs.shards:
            try:
                due = await self.redis.zrangebyscore(shard.deadlines, "-inf", now, start=0, num=SWEEP_MOST)
                if not due:
                    continue
                found = await spine.load_many(self.jobs, due)
            except REDIS_OUTAGE as exc:  # that shard's Redis is away: sweep the others
                log.warning("expiring in %s failed: %s", shard.prefix, type(exc).__name__)
                continue
            for rid, job in zip(due, found, strict=True):
                if isinstance(job, Exception):  # one broken request must not stop the sweep of the others
                    log.warning("expiring %s failed: %s", rid, job)
            loaded = [(rid, job) for rid, job in zip(due, found, strict=True) if not isinstance(job, Exception)]
            gone = [rid for rid, job in loaded if job is None or job.state.terminal]
            overdue = [
                job
                for _, job in loaded
                if job is not None
                and (job.state == State.QUEUED or (job.state == State.RUNNING and now > job.deadline + grace))
            ]
            outcomes = await asyncio.gather(
                *(spine.expire(self.jobs, job) for job in overdue),
                *([self.redis.zrem(shard.deadlines, *gone)] if gone else []),
                return_exceptions=True,
            )
            for outcome in outcomes:
                if isinstance(outcome, Exception):  # one bad request must not stop the sweep of the others
                    log.warning("expiring in %s failed: %s", shard.prefix, outcome)
