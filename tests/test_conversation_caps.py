"""Per-tenant conversation caps: a tenant keeps at most TENANT_MAX_CONVERSATIONS (403
conversation_count_quota_exceeded on the create beyond, room again once one is deleted),
and creating or updating one counts as a request against its requests per minute."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from tests.bounds import Watch
from tests.test_tenants import client_for, new_key, set_tenant

MOST = 3


@pytest.fixture(scope="module")
def capped_gateway(stack) -> Iterator[tuple[str, int]]:
    """The gateway's URL and pid (its loop's pauses and memory are read while the test sends)."""
    process, url = stack.start_gateway("gateway-conversation-caps", TENANT_MAX_CONVERSATIONS=str(MOST))
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


@pytest.fixture(scope="module")
def capped(capped_gateway: tuple[str, int]) -> str:
    return capped_gateway[0]


async def test_a_tenant_keeps_at_most_its_conversations_and_a_delete_makes_room(stack, capped) -> None:
    async with client_for(stack, await new_key(stack, "tenant-conversation-count"), url=capped) as client:
        made = [await client.post("/v1/conversations", json={}) for _ in range(MOST)]
        assert all(answer.status_code == 200 for answer in made), [a.text for a in made]
        over = await client.post("/v1/conversations", json={})
        assert over.status_code == 403, over.text
        assert over.json()["error"]["code"] == "conversation_count_quota_exceeded"
        await client.delete(f"/v1/conversations/{made[0].json()['id']}")
        again = await client.post("/v1/conversations", json={})
    assert again.status_code == 200, again.text


async def test_creating_and_updating_a_conversation_count_against_requests_per_minute(stack, capped) -> None:
    tenant = "tenant-conversation-rpm"
    await set_tenant(stack, tenant, limits={"requests_per_minute": 2})
    async with client_for(stack, await new_key(stack, tenant), url=capped) as client:
        created = await client.post("/v1/conversations", json={})
        assert created.status_code == 200, created.text
        conversation = created.json()["id"]
        updated = await client.post(f"/v1/conversations/{conversation}", json={"metadata": {"a": "b"}})
        assert updated.status_code == 200, updated.text
        third = await client.post(f"/v1/conversations/{conversation}", json={"metadata": {"a": "c"}})
        fourth = await client.post("/v1/conversations", json={})
    assert (third.status_code, fourth.status_code) == (429, 429), (third.text, fourth.text)


async def test_concurrent_creates_cannot_all_pass_the_conversation_quota(stack, capped_gateway) -> None:
    capped, pid = capped_gateway
    async with client_for(stack, await new_key(stack, "tenant-conversation-race"), url=capped) as client:
        with Watch(capped, pid) as seen:
            answers = await asyncio.gather(*(client.post("/v1/conversations", json={}) for _ in range(12)))
        assert seen.pauses == 0 and seen.grown < 100 << 20, seen
    made = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 403]
    assert len(made) == MOST and len(refused) == 12 - MOST, [a.text for a in answers]
    assert all(a.json()["error"]["code"] == "conversation_count_quota_exceeded" for a in refused)
