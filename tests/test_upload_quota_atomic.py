"""Stored quotas are atomic: an upload is reserved against its tenant's file quota (beside
the files it keeps and every other upload being stored) before it is stored, and released
when it ends, however; so 20 concurrent uploads cannot all pass a quota that fits 5."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.test_tenants import client_for, new_key

QUOTA = 5 * (1 << 20)
FILE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' * 13_000  # ~1 MiB


@pytest.fixture(scope="module")
def small_quota(stack) -> Iterator[str]:
    process, url = stack.start_gateway("gateway-upload-quota", TENANT_MAX_FILE_BYTES=str(QUOTA))
    yield url
    stack.stop(process)


async def upload(client: httpx.AsyncClient) -> httpx.Response:
    return await client.post("/v1/files", files={"file": ("in.jsonl", FILE)}, data={"purpose": "batch"})


async def test_twenty_concurrent_uploads_cannot_all_pass_a_small_quota(stack, small_quota) -> None:
    assert len(FILE) <= 1 << 20
    async with client_for(stack, await new_key(stack, "tenant-upload-race"), url=small_quota) as client:
        answers = await asyncio.gather(*(upload(client) for _ in range(20)))
        stored = [a.json() for a in answers if a.status_code == 200]
        refused = [a for a in answers if a.status_code != 200]
        assert all(a.status_code == 403 for a in refused), [a.text for a in refused]
        assert {a.json()["error"]["code"] for a in refused} <= {"file_bytes_quota_exceeded"}
        assert sum(f["bytes"] for f in stored) <= QUOTA, f"{len(stored)} files stored"
        assert len(stored) == QUOTA // len(FILE)  # the reservations of refused ones were released
        for found in stored:
            await client.delete(f"/v1/files/{found['id']}")
        again = await upload(client)
    assert again.status_code == 200, again.text  # every reservation released
