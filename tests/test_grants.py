"""A tenant's grant (its weight, its priority band and its limits) is an operator's: the
tenant's own admin may tighten its limits within the grant, never lift them, its weight or
its band; a key of a tenant without the high band cannot ask for priority."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.conftest import AUTH
from tests.test_tenants import client_for, new_key, set_tenant

GRANT = {
    "weight": 1.0,
    "limits": {"requests_per_minute": 60, "tokens_per_minute": 10_000, "max_concurrent": 2, "max_queued": 10},
}
EMBED = {"model": "text_embed", "inputs": {"text": "a granted request"}}


async def read_tenant(stack, tenant: str) -> dict:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        response = await operator.get(f"/admin/tenants/{tenant}")
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize(
    ("change", "code"),
    [
        ({"weight": 1000}, "grant_operator_only"),
        ({"priority": "high"}, "grant_operator_only"),
        ({"limits": {"requests_per_minute": 0, "tokens_per_minute": 0}}, None),  # 0: the grant's, not none
        ({"limits": {"requests_per_minute": 61}}, "limit_over_grant"),
        ({"limits": {"tokens_per_minute": 10_001}}, "limit_over_grant"),
        ({"limits": {"max_concurrent": 3}}, "limit_over_grant"),
        ({"limits": {"max_queued": 1_000_000_000}}, "limit_over_grant"),
        ({"own_limits": {"max_queued": 11}}, "limit_over_grant"),
    ],
)
async def test_a_tenant_admin_cannot_lift_any_part_of_its_grant(stack, change, code) -> None:
    tenant = f"tenant-grant-{abs(hash(str(change))) % 10**8}"
    await set_tenant(stack, tenant, **GRANT)
    before = await read_tenant(stack, tenant)
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        response = await admin.put(f"/admin/tenants/{tenant}", json=change)
    if code is None:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == code
    after = await read_tenant(stack, tenant)
    assert (after["weight"], after["priority"], after["limits"]) == (
        before["weight"],
        before["priority"],
        before["limits"],
    )
    assert after["effective_limits"] == GRANT["limits"]


async def test_a_tenant_admin_tightens_its_limits_within_the_grant_and_they_bind(stack) -> None:
    tenant = "tenant-grant-tighter"
    await set_tenant(stack, tenant, limits={"requests_per_minute": 60})
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        response = await admin.put(f"/admin/tenants/{tenant}", json={"limits": {"requests_per_minute": 2}})
        assert response.status_code == 200, response.text
        assert response.json()["limits"]["requests_per_minute"] == 60  # the grant is unchanged
        assert response.json()["effective_limits"]["requests_per_minute"] == 2
        answers = [(await admin.post("/infer", json=EMBED)).status_code for _ in range(3)]
    assert answers == [202, 202, 429]


async def test_a_tenant_admin_back_at_zero_follows_the_grant_again(stack) -> None:
    tenant = "tenant-grant-back"
    await set_tenant(stack, tenant, limits={"max_concurrent": 4})
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        tightened = await admin.put(f"/admin/tenants/{tenant}", json={"limits": {"max_concurrent": 1}})
        assert tightened.json()["effective_limits"]["max_concurrent"] == 1
        back = await admin.put(f"/admin/tenants/{tenant}", json={"limits": {"max_concurrent": 0}})
    assert back.status_code == 200, back.text
    assert back.json()["effective_limits"]["max_concurrent"] == 4


async def test_an_operator_lowering_the_grant_lowers_what_the_tenant_set_above_it(stack) -> None:
    tenant = "tenant-grant-lowered"
    await set_tenant(stack, tenant, limits={"max_queued": 50})
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        assert (await admin.put(f"/admin/tenants/{tenant}", json={"limits": {"max_queued": 40}})).status_code == 200
    await set_tenant(stack, tenant, limits={"max_queued": 5})
    assert (await read_tenant(stack, tenant))["effective_limits"]["max_queued"] == 5


async def test_priority_without_the_grant_is_refused_by_name(stack) -> None:
    key = await new_key(stack, "tenant-no-priority")
    async with client_for(stack, key) as user:
        response = await user.post("/infer", json={**EMBED, "priority": 1})
        normal = await user.post("/infer", json=EMBED)
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "priority_not_granted"
    assert normal.status_code == 202
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.PermissionDeniedError) as refused:
        await client.chat.completions.create(
            model="llm_echo", messages=[{"role": "user", "content": "hi"}], max_tokens=1, service_tier="priority"
        )
    assert refused.value.code == "priority_not_granted"
    await client.close()


async def test_a_tenant_granted_the_high_band_may_ask_for_priority(stack) -> None:
    await set_tenant(stack, "tenant-with-priority", priority="high")
    async with client_for(stack, await new_key(stack, "tenant-with-priority")) as user:
        response = await user.post("/infer", json={**EMBED, "priority": 1})
    assert response.status_code == 202, response.text


async def test_a_tenant_admin_still_sets_its_webhook_secrets_and_endpoint(stack) -> None:
    tenant = "tenant-grant-webhooks"
    await set_tenant(stack, tenant, **GRANT)
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        response = await admin.put(
            f"/admin/tenants/{tenant}", json={"openai_webhook_url": "http://127.0.0.1:9/hooks", "webhook_secrets": []}
        )
    assert response.status_code == 200, response.text
    assert response.json()["openai_webhook_url"] == "http://127.0.0.1:9/hooks"
