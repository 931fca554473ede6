"""The API key quota is atomic: each key an admin creates through the API is reserved
against TENANT_MAX_KEYS beside the keys not revoked and every other create in flight, so
12 concurrent creates against a quota of 3 make 3 (the others 403 key_quota_exceeded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.server.errors import Forbidden
from gateway.server.tenants.keys import KeyStore
from tests.conftest import AUTH

MOST = 3


@pytest.fixture(scope="module")
def capped(stack) -> Iterator[str]:
    process, url = stack.start_gateway("gateway-key-quota", TENANT_MAX_KEYS=str(MOST))
    yield url
    stack.stop(process)


async def test_concurrent_key_creates_cannot_all_pass_the_key_quota(stack, capped) -> None:
    # Before: each create counted the keys not revoked, then inserted one; all 12 counted 0.
    tenant = f"tenant-key-race-{time.time_ns()}"
    async with httpx.AsyncClient(base_url=capped, headers=AUTH, timeout=60) as operator:
        answers = await asyncio.gather(*(operator.post("/admin/keys", json={"tenant": tenant}) for _ in range(12)))
        listed = (await operator.get("/admin/keys", params={"tenant": tenant})).json()["keys"]
    made = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(made) == MOST, [a.text for a in answers]
    assert all(a.status_code == 403 for a in refused), [a.text for a in refused]
    assert all(a.json()["error"]["code"] == "key_quota_exceeded" for a in refused)
    assert len([k for k in listed if not k["revoked"]]) == MOST


async def test_concurrent_creates_in_the_key_store_cannot_all_pass_the_key_quota(stack, mongo, redis) -> None:
    # The store on its own, its creates all begun at once: without the reservation each
    # counted the keys not revoked before any was inserted, and all 12 passed.
    keys = KeyStore(mongo, f"key_quota_{time.time_ns()}", cache_s=0)
    tenant = f"tenant-key-store-race-{time.time_ns()}"
    answers = await asyncio.gather(
        *(keys.create(tenant, max_keys=MOST, redis=redis) for _ in range(12)), return_exceptions=True
    )
    made = [a for a in answers if isinstance(a, tuple)]
    refused = [a for a in answers if isinstance(a, Forbidden)]
    assert len(made) == MOST and len(refused) == 12 - MOST, answers
    assert len([k for k in await keys.list(tenant) if not k.revoked]) == MOST
