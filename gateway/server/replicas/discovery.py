"""Finding the Triton replicas by DNS: on Kubernetes a headless Service answers one
record per ready Triton pod. A loop re-resolves the name every DISCOVERY_INTERVAL_S and
gives the addresses to ReplicaPool.set_urls, so replicas added behind the name are
probed and then used, and removed ones take no new work and close once idle, without a
restart.

A failed or empty answer keeps the replicas the pool has: a DNS outage, or a moment in a
rollout when no pod is ready, must not empty the pool (the pool's own probes still take
unhealthy replicas out of rotation).

The resolver is injectable. Tests use `hosts_file_resolver` (setting
DISCOVERY_TEST_HOSTS_FILE), which reads the addresses from a file instead of DNS."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from gateway.common.retry import LoopHealth, cancel_and_wait, supervise
from gateway.protocol.records import replica_name
from gateway.server.metrics import GatewayMetrics
from gateway.server.replicas.pool import ReplicaPool
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

# (name, port) -> the replicas' gRPC addresses, "host:port" each.
Resolver = Callable[[str, int], Awaitable[list[str]]]


def grpc_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def dns_resolver(name: str, port: int) -> list[str]:
    """Every address the name has (A and AAAA), through the event loop's getaddrinfo,
    which runs the system resolver in a thread and so honours resolv.conf's search
    domains: a short Service name works inside its namespace."""
    infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({grpc_address(str(info[4][0]), port) for info in infos})


def hosts_file_resolver(path: Path) -> Resolver:
    """Test hook: the addresses "resolved" for the name are the lines of this file
    (`host` or `host:port`; `#` comments), read afresh on every resolution."""

    async def resolve(name: str, port: int) -> list[str]:
        text = await asyncio.to_thread(path.read_text)
        lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
        return sorted({line if ":" in line else grpc_address(line, port) for line in lines if line})

    return resolve


class ReplicaDiscovery:
    def __init__(
        self,
        pool: ReplicaPool,
        name: str,
        port: int,
        *,
        interval_s: float,
        resolver: Resolver = dns_resolver,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self.pool = pool
        self.name = name
        self.port = port
        self.interval_s = interval_s
        self.resolver = resolver
        self.metrics = metrics
        self.health = LoopHealth("replica discovery")
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        # Replicas with a label in the per-replica gauges, to drop those labels once the
        # pool has closed the replica (the sweeper only updates replicas it still has).
        self._labelled: set[str] = set()

    async def start(self) -> None:
        """Resolve once before serving, then keep resolving in the background."""
        await self.refresh()
        self._task = asyncio.create_task(supervise(self.health, self._run), name="replica-discovery")

    async def stop(self) -> None:
        if self._task:
            await cancel_and_wait([self._task])

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.refresh()

    async def refresh(self) -> bool:
        """One resolution applied to the pool; False (pool unchanged) when the name gave
        no address."""
        try:
            urls = await self.resolver(self.name, self.port)
        except OSError as exc:  # socket.gaierror: NXDOMAIN, no answer, resolver down
            urls, error = [], f"{type(exc).__name__}: {exc}"
        else:
            error = "no address"
        if not urls:
            if not self._failing:  # once per outage, not once per interval
                known = sum(1 for r in self.pool.replicas if not r.removed)
                log.warning("discovery of %s failed (%s); keeping the %d known replicas", self.name, error, known)
            self._failing = True
            return False
        if self._failing:
            log.info("discovery of %s answers again: %s", self.name, ", ".join(urls))
        self._failing = False
        await self.pool.set_urls(urls)
        self._forget_closed()
        return True

    def _forget_closed(self) -> None:
        present = {r.url for r in self.pool.replicas}
        if self.metrics is not None:
            for url in self._labelled - present:
                for gauge in (self.metrics.replica_healthy, self.metrics.inflight):
                    try:
                        gauge.remove(replica_name(url))  # the sweeper's label
                    except KeyError:  # never labelled (closed before a sweep saw it)
                        pass
        self._labelled = present


def replica_discovery(
    settings: GatewaySettings, pool: ReplicaPool, metrics: GatewayMetrics | None = None
) -> ReplicaDiscovery | None:
    """The discovery loop the settings ask for; None without TRITON_DNS_NAME (the pool
    keeps the static TRITON_GRPC_URLS)."""
    if not settings.triton_dns_name:
        return None
    test_file = settings.discovery_test_hosts_file
    return ReplicaDiscovery(
        pool,
        settings.triton_dns_name,
        settings.triton_dns_port,
        interval_s=settings.discovery_interval_s,
        resolver=hosts_file_resolver(test_file) if test_file else dns_resolver,
        metrics=metrics,
    )
