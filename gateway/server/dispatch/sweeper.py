"""Housekeeping every gateway does (any may, all at once is harmless): expire requests
whose deadline passed while they waited (or whose dispatcher died), trim acknowledged
queue entries, forget queues unused for longer than any request can live, and keep the
backlog gauge."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.asyncio import Redis

from gateway.common.streams import StreamConsumer
from gateway.protocol import ErrorInfo, ResultRecord, State
from gateway.protocol.redis_keys import DEADLINES, QUEUE_REGISTRY
from gateway.server.dispatch.scheduler import QueueRegistry
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

TRIM_EVERY_S = 30.0


class Sweeper:
    def __init__(
        self,
        redis: Redis,
        jobs: JobStore,
        consumer: StreamConsumer,
        queues: QueueRegistry,
        pool: ReplicaPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        on_finished: Callable[[ResultRecord], None],
    ) -> None:
        self.redis = redis
        self.jobs = jobs
        self.consumer = consumer
        self.queues = queues
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.on_finished = on_finished
        self._last_trim = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            await self.sweep()

    async def sweep(self) -> None:
        await self.expire_overdue()
        backlog = await self.jobs.backlog()
        self.metrics.backlog.set(backlog.get("all", 0))
        for replica in self.pool.replicas:
            self.metrics.replica_healthy.labels(replica.url).set(1 if replica.healthy else 0)
            self.metrics.inflight.labels(replica.url).set(replica.inflight)
        if time.monotonic() - self._last_trim > TRIM_EVERY_S:
            self._last_trim = time.monotonic()
            await self.trim()

    async def expire_overdue(self) -> None:
        now = time.time()
        # Running requests get a grace period: their own dispatcher expires them first.
        grace = self.settings.claim_idle_ms / 1000
        for request_id in await self.redis.zrangebyscore(DEADLINES, "-inf", now, start=0, num=200):
            try:
                job = await self.jobs.load(request_id)
                if job is None:
                    await self.redis.zrem(DEADLINES, request_id)
                elif job.state == State.QUEUED or (job.state == State.RUNNING and now > job.deadline + grace):
                    error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed before it ended")
                    record = job.record(State.EXPIRED, error=error)
                    if await self.jobs.finish(record, allowed=(job.state,)) is not None:
                        self.on_finished(record)
                elif job.state.terminal:
                    await self.redis.zrem(DEADLINES, request_id)
            except Exception as exc:  # one bad request must not stop the sweep of the others
                log.warning("expiring %s failed: %s", request_id, exc)

    async def trim(self) -> None:
        await self.queues.refresh(force=True)
        for stream in self.queues.all():
            await self.consumer.trim(stream)
        # Queues unused for longer than any request can live hold nothing to run.
        await self.redis.zremrangebyscore(QUEUE_REGISTRY, "-inf", time.time() - self.queues.window_s)
