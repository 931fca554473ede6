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
from gateway.server import spine
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)


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
            self.metrics.replica_healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.metrics.inflight.labels(replica.url).set(replica.inflight)

    async def expire_overdue(self) -> None:
        now = time.time()
        # Running requests get a grace period: their own dispatcher expires them first.
        grace = self.settings.claim_idle_ms / 1000
        for shard in self.jobs.shards:
            for request_id in await self.redis.zrangebyscore(shard.deadlines, "-inf", now, start=0, num=200):
                try:
                    job = await spine.load(self.jobs, request_id)
                    if job is None:
                        await self.redis.zrem(shard.deadlines, request_id)
                    elif job.state == State.QUEUED or (job.state == State.RUNNING and now > job.deadline + grace):
                        await spine.expire(self.jobs, job)
                    elif job.state.terminal:
                        await self.redis.zrem(shard.deadlines, request_id)
                except Exception as exc:  # one bad request must not stop the sweep of the others
                    log.warning("expiring %s failed: %s", request_id, exc)
