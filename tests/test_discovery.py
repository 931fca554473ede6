"""DNS discovery of Triton replicas: a real gateway process picks up a replica added
behind the name and drops one removed, without a restart. The name's addresses come from
a file (DISCOVERY_TEST_HOSTS_FILE) that the test rewrites, as a headless Service's
records change when pods come and go."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest

from gateway.protocol.records import replica_name
from gateway.server.replicas import ReplicaPool
from gateway.server.replicas.discovery import ReplicaDiscovery, dns_resolver
from tests.conftest import AUTH
from tests.gateway_calls import llm_body, submit, wait_all

DNS_NAME = "triton-headless.test.svc.cluster.local"


async def _healthy_replicas(client: httpx.AsyncClient) -> dict[str, float]:
    """gateway_replica_healthy by replica, from the gateway's /metrics."""
    found = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("gateway_replica_healthy{"):
            labels, value = line.rsplit(" ", 1)
            found[labels.split('replica="', 1)[1].split('"', 1)[0]] = float(value)
    return found


async def _until(check: Callable[[], Awaitable[bool]], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def _replicas_used(client: httpx.AsyncClient, count: int, tag: str) -> set[str]:
    ids = await asyncio.gather(*(submit(client, llm_body(f"{tag} {i}", 8)) for i in range(count)))
    records = await wait_all(client, list(ids), timeout=60)
    assert {r["status"] for r in records} == {"succeeded"}, records
    return {r["replica"] for r in records}  # replica_name() of each


@pytest.fixture
def second_triton(stack):
    """A second Triton replica (its start, up to a minute on a busy machine, is bounded
    by the launcher, not by the test's own limit)."""
    process, url = stack.start_triton("triton-discovered")
    yield url
    stack.stop(process)


@pytest.mark.timeout(90, func_only=True)
async def test_a_replica_added_behind_the_name_is_used_and_a_removed_one_dropped(
    stack, second_triton: str, tmp_path: Path
) -> None:
    first, second = stack.triton_grpc, second_triton
    hosts = tmp_path / "triton-headless.hosts"
    hosts.write_text(f"{first}\n")
    gateway, url = stack.start_gateway(
        "gateway-discovery",
        REDIS_URL=stack.redis_db_url(12),
        TRITON_GRPC_URLS="127.0.0.1:9",  # ignored: the name decides
        TRITON_DNS_NAME=DNS_NAME,
        DISCOVERY_INTERVAL_S="0.2",
        DISCOVERY_TEST_HOSTS_FILE=str(hosts),
    )
    try:
        async with httpx.AsyncClient(headers=AUTH, base_url=url, timeout=30) as client:
            await _until(lambda: _has_gauges(client, {first: 1.0}))
            assert await _replicas_used(client, 6, "before") == {replica_name(first)}

            hosts.write_text(f"{first}\n{second}\n")  # a pod joined the Service
            await _until(lambda: _has_gauges(client, {first: 1.0, second: 1.0}))
            assert await _replicas_used(client, 16, "scaled out") == {replica_name(first), replica_name(second)}

            hosts.write_text(f"{first}\n")  # that pod left (it is still running)
            await _until(lambda: _has_gauges(client, {first: 1.0}))
            assert await _replicas_used(client, 8, "scaled in") == {replica_name(first)}
        assert gateway.exit_code() is None, "the gateway restarted"
    finally:
        stack.stop(gateway)


async def _has_gauges(client: httpx.AsyncClient, expected: dict[str, float]) -> bool:
    # The gauges name replicas as records do (replica_name), never by address.
    return await _healthy_replicas(client) == {replica_name(url): value for url, value in expected.items()}


async def test_a_failed_resolution_keeps_the_known_replicas() -> None:
    answers: list[list[str] | OSError] = [["127.0.0.1:9"], OSError("NXDOMAIN"), []]

    async def resolver(name: str, port: int) -> list[str]:
        answer = answers.pop(0)
        if isinstance(answer, OSError):
            raise answer
        return answer

    pool = ReplicaPool([], max_inflight=1, probe_interval_s=60, probe_timeout_s=0.5)
    discovery = ReplicaDiscovery(pool, DNS_NAME, 8001, interval_s=60, resolver=resolver)
    try:
        assert await discovery.refresh() is True
        assert await discovery.refresh() is False
        assert await discovery.refresh() is False
        assert [(r.url, r.removed) for r in pool.replicas] == [("127.0.0.1:9", False)]
    finally:
        await pool.close()


async def test_the_dns_resolver_gives_every_address_with_the_port() -> None:
    addresses = await dns_resolver("localhost", 8001)
    assert addresses
    assert all(a.endswith(":8001") for a in addresses)
    assert set(addresses) <= {"127.0.0.1:8001", "[::1]:8001"}
