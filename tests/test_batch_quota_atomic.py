"""The active batches quota is atomic: each create is reserved against TENANT_MAX_ACTIVE_BATCHES
beside the batches not ended and every other create in flight, so 12 concurrent creates
against a quota of 3 make 3 (the others 429 active_batches_quota_exceeded)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from tests.bounds import Watch
from tests.test_openai_batches import jsonl
from tests.test_tenants import client_for, new_key

MOST = 3
# One line of a minute of tokens: a batch of it stays in progress through the test.
LONG_LINE = {
    "custom_id": "long",
    "method": "POST",
    "url": "/v1/completions",
    "body": {"model": "llm_synthetic", "prompt": "go on", "max_tokens": 3000},
}


@pytest.fixture(scope="module")
def capped_gateway(stack) -> Iterator[tuple[str, int]]:
    """The gateway's URL and pid (its loop's pauses and memory are read while the test sends)."""
    process, url = stack.start_gateway("gateway-batch-quota", TENANT_MAX_ACTIVE_BATCHES=str(MOST))
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


@pytest.fixture(scope="module")
def capped(capped_gateway: tuple[str, int]) -> str:
    return capped_gateway[0]


async def test_concurrent_batch_creates_cannot_all_pass_the_active_batches_quota(stack, capped_gateway) -> None:
    # Before: each create counted the batches not ended, then created one; all 12 counted 0.
    capped, pid = capped_gateway
    async with client_for(stack, await new_key(stack, f"tenant-batch-race-{time.time_ns()}"), url=capped) as client:
        uploaded = await client.post(
            "/v1/files", files={"file": ("in.jsonl", jsonl([LONG_LINE]))}, data={"purpose": "batch"}
        )
        assert uploaded.status_code == 200, uploaded.text
        body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
        with Watch(capped, pid) as seen:
            answers = await asyncio.gather(*(client.post("/v1/batches", json=body) for _ in range(12)))
        assert seen.pauses == 0 and seen.grown < 100 << 20, seen
        made = [a.json()["id"] for a in answers if a.status_code == 200]
        for batch_id in made:
            await client.post(f"/v1/batches/{batch_id}/cancel")
    refused = [a for a in answers if a.status_code != 200]
    assert len(made) == MOST, [a.text for a in answers]
    assert all(a.status_code == 429 for a in refused), [a.text for a in refused]
    assert all(a.json()["error"]["code"] == "active_batches_quota_exceeded" for a in refused)
