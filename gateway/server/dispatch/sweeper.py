"""Housekeeping every gateway does (any may, all at once is harmless): every
SWEEP_INTERVAL_S, each shard swept for the ends no run reaches (spine.sweep: running
requests whose lease ran out, their dispatcher dead, put back in line; requests whose
deadline passed while they waited, or whose run stopped being renewed, expired), and the
replica gauges kept (the backlog gauge is the dispatcher's: it reads the backlog anyway)."""

from __future__ import annotations

import asyncio

from gateway.protocol.records import replica_name
from gateway.server import spine
from gateway.server.metrics import GatewayMetrics
from gateway.server.queue.jobs import JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.settings import GatewaySettings


class Sweeper:
    def __init__(
        self,
        jobs: JobStore,
        pool: ReplicaPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
    ) -> None:
        self.jobs = jobs
        self.pool = pool
        self.settings = settings
        self.metrics = metrics

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            await self.sweep()

    async def sweep(self) -> None:
        # Running requests get a grace period: their own dispatcher expires them first.
        grace_s = self.settings.claim_idle_ms / 1000
        for shard in self.jobs.shards:
            await spine.sweep(self.jobs, shard, grace_s=grace_s)
        for replica in self.pool.replicas:
            # Labelled as records name replicas: /metrics may be public, the addresses are
            # not (GET /admin/replicas maps names to addresses).
            name = replica_name(replica.url)
            self.metrics.replica_healthy.labels(name).set(1 if replica.healthy else 0)
            self.metrics.inflight.labels(name).set(replica.inflight)
