"""Tenants in the binder's vector index, against binders started by the tests: a search
sees only its tenant's vectors (k of them, however many closer ones another tenant
holds), and every result keeps its tenant through a snapshot and a rebuild from MongoDB."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx
import numpy as np
import pytest
import redis.asyncio as aioredis

from gateway.common.result_store import RESULTS_COLLECTION, ResultStore
from gateway.protocol import ResultRecord
from tests.conftest import AUTH
from tests.records import RESULTS_STREAM, embedding_record, publish, unit_vectors

DIM = 384
K = 5
_databases = itertools.count(35)


@pytest.fixture
def isolated(stack) -> dict[str, str]:
    number = next(_databases)
    return {"REDIS_URL": stack.redis_db_url(number), "MONGO_DB": f"tenant_test_{number}_{time.time_ns()}"}


def _query() -> np.ndarray:
    return unit_vectors(1, DIM, seed=20)[0]


def _records() -> tuple[list[ResultRecord], list[ResultRecord]]:
    """Tenant a: 20 results all nearer the query than any of tenant b's 8."""
    near = _query() + 0.05 * unit_vectors(20, DIM, seed=21)
    near /= np.linalg.norm(near, axis=1, keepdims=True)
    a = [embedding_record(v.tolist(), tenant="tenant-a") for v in near]
    b = [embedding_record(v.tolist(), tenant="tenant-b") for v in unit_vectors(8, DIM, seed=22)]
    return a, b


async def _search(url: str, tenant: str) -> list[str]:
    async with httpx.AsyncClient(headers=AUTH, base_url=url) as client:
        body = {"space": "minilm", "vector": _query().tolist(), "k": K, "tenant": tenant}
        response = await client.post("/search", json=body)
    assert response.status_code == 200, response.text
    return [hit["request_id"] for hit in response.json()["hits"]]


async def _until(check, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.1)


async def _health(url: str) -> dict:
    async with httpx.AsyncClient(headers=AUTH) as client:
        return (await client.get(f"{url}/healthz")).json()


async def _indexed(url: str, expected: int) -> bool:
    return (await _health(url))["index"].get("minilm", 0) == expected


async def _snapshotted(url: str, expected: int) -> bool:
    """The binder's last snapshot on disk holds that many minilm vectors."""
    return ((await _health(url))["snapshot"] or {}).get("minilm", 0) == expected


async def _each_sees_only_its_own(url: str, a: list[ResultRecord], b: list[ResultRecord]) -> None:
    hits_b = await _search(url, "tenant-b")
    assert len(hits_b) == K and set(hits_b) <= {r.request_id for r in b}
    hits_a = await _search(url, "tenant-a")
    assert len(hits_a) == K and set(hits_a) <= {r.request_id for r in a}
    assert await _search(url, "tenant-c") == []


async def test_a_tenants_search_returns_its_own_k_nearest_and_never_another_tenants(stack, isolated) -> None:
    process, url = stack.start_binder("binder-tenants", **isolated)
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    try:
        a, b = _records()
        await publish(redis, a + b)
        await _until(lambda: _indexed(url, len(a) + len(b)))
        await _each_sees_only_its_own(url, a, b)
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_a_binder_restarted_from_its_snapshot_keeps_each_results_tenant(stack, mongo, isolated) -> None:
    redis = aioredis.from_url(isolated["REDIS_URL"], decode_responses=True)
    a, b = _records()
    name = f"binder-tenant-snapshot-{time.time_ns()}"  # its snapshot folder is named after it
    process, url = stack.start_binder(name, **isolated)
    try:
        await publish(redis, a + b)
        # A snapshot of all of them, before the stop: the stop's own last snapshot may not be
        # written before SIGKILL on a busy machine (stop_processes waits 3 s).
        await _until(lambda: _snapshotted(url, len(a) + len(b)))
    finally:
        stack.stop(process)
    # Neither the stream nor MongoDB can tell the restarted binder anything: only its snapshot.
    await redis.delete(RESULTS_STREAM)
    await mongo.drop_database(isolated["MONGO_DB"])
    process, url = stack.start_binder(name, **isolated)
    try:
        assert await _indexed(url, len(a) + len(b))  # loaded before it answers ready
        await _each_sees_only_its_own(url, a, b)
    finally:
        stack.stop(process)
        await redis.aclose()


async def test_a_binder_rebuilt_from_mongodb_keeps_each_results_tenant(stack, mongo, isolated) -> None:
    a, b = _records()
    store = ResultStore(mongo, isolated["MONGO_DB"], retention_s=3600)
    assert (await store.insert(a + b)).stored  # as the archiver stores them; no stream to replay
    assert await mongo[isolated["MONGO_DB"]][RESULTS_COLLECTION].count_documents({}) == len(a) + len(b)
    process, url = stack.start_binder("binder-tenant-rebuild", **isolated)
    try:
        await _until(lambda: _indexed(url, len(a) + len(b)))
        await _each_sees_only_its_own(url, a, b)
    finally:
        stack.stop(process)
