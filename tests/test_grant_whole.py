"""The grant whole: no own limit of a tenant's admin may exceed what its grant means, on an
explicit grant and on the default one, where max_queued 0 means "the tenant's share of the
backlog" (not "no limit") and the other limits at 0 mean no limit. A try to exceed any part
gets 403 limit_over_grant and leaves the grant and the own limits as they were; an own
max_queued above the share stored before this check (or by an operator) is held to the
share at admission."""

from __future__ import annotations

import math

import httpx
import pytest

from gateway.server.settings import GatewaySettings
from gateway.server.submission import admission
from gateway.server.tenants.caller import Caller
from gateway.server.tenants.config import LIMIT_MAX, TenantConfig, TenantLimits
from tests.conftest import AUTH
from tests.test_tenants import client_for, new_key, set_tenant

DEFAULTS = GatewaySettings()  # the stack's gateway runs the defaults for these


def backlog_share(whole: int, fraction: float) -> int:
    return max(1, math.floor(whole * fraction))


SHARE = min(
    backlog_share(DEFAULTS.max_backlog, DEFAULTS.tenant_backlog_share),
    backlog_share(DEFAULTS.max_batch_backlog, DEFAULTS.tenant_backlog_share),
)
EXPLICIT = {"requests_per_minute": 60, "tokens_per_minute": 10_000, "max_concurrent": 2, "max_queued": 10}


async def read_tenant(stack, tenant: str) -> dict:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH) as operator:
        response = await operator.get(f"/admin/tenants/{tenant}")
    assert response.status_code == 200, response.text
    return response.json()


async def own_change(stack, tenant: str, group: str, name: str, value: int) -> tuple[httpx.Response, dict, dict]:
    """The tenant's settings before, the answer to its admin's change, and the settings after."""
    before = await read_tenant(stack, tenant)
    async with client_for(stack, await new_key(stack, tenant, "admin")) as admin:
        response = await admin.put(f"/admin/tenants/{tenant}", json={group: {name: value}})
    return response, before, await read_tenant(stack, tenant)


def assert_refused_and_unchanged(response: httpx.Response, before: dict, after: dict) -> None:
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == "limit_over_grant"
    keep = ("weight", "priority", "limits", "own_limits", "effective_limits")
    assert {k: after[k] for k in keep} == {k: before[k] for k in keep}


@pytest.mark.parametrize("group", ["limits", "own_limits"])
async def test_a_tenant_admin_cannot_lift_max_queued_above_its_share_on_the_default_grant(stack, group) -> None:
    tenant = f"tenant-whole-default-queued-{group}"
    response, before, after = await own_change(stack, tenant, group, "max_queued", SHARE + 1)
    assert_refused_and_unchanged(response, before, after)
    assert response.json()["error"]["details"]["granted"] == SHARE


async def test_a_tenant_admin_cannot_set_a_billion_max_queued_on_the_default_grant(stack) -> None:
    response, before, after = await own_change(stack, "tenant-whole-billion", "limits", "max_queued", LIMIT_MAX)
    assert_refused_and_unchanged(response, before, after)


async def test_a_tenant_admin_may_set_max_queued_up_to_its_share_on_the_default_grant(stack) -> None:
    response, _, after = await own_change(stack, "tenant-whole-at-share", "limits", "max_queued", SHARE)
    assert response.status_code == 200, response.text
    assert after["effective_limits"]["max_queued"] == SHARE
    assert after["limits"]["max_queued"] == 0  # the grant is still the share


@pytest.mark.parametrize("name", ["requests_per_minute", "tokens_per_minute", "max_concurrent"])
async def test_on_the_default_grant_a_limit_without_a_bound_may_only_be_tightened(stack, name) -> None:
    # 0 on the default grant means no limit for these: any own value is a tightening, and binds.
    response, _, after = await own_change(stack, f"tenant-whole-default-{name}", "limits", name, 7)
    assert response.status_code == 200, response.text
    assert after["effective_limits"][name] == 7
    assert after["limits"][name] == 0


@pytest.mark.parametrize("group", ["limits", "own_limits"])
@pytest.mark.parametrize("name", sorted(EXPLICIT))
async def test_a_tenant_admin_cannot_exceed_any_limit_of_an_explicit_grant(stack, name, group) -> None:
    tenant = f"tenant-whole-explicit-{name}-{group}"
    await set_tenant(stack, tenant, limits=EXPLICIT)
    response, before, after = await own_change(stack, tenant, group, name, EXPLICIT[name] + 1)
    assert_refused_and_unchanged(response, before, after)
    assert after["effective_limits"] == EXPLICIT


@pytest.mark.parametrize("band", ["normal", "batch"])
def test_an_own_max_queued_stored_above_the_share_is_held_to_the_share_at_admission(band) -> None:
    # As one set before the check existed (or written by an operator as own_limits).
    config = TenantConfig(tenant="t", own_limits=TenantLimits(max_queued=LIMIT_MAX))
    admitted = admission(DEFAULTS, Caller(tenant="t", config=config), band, shards=1)
    whole = DEFAULTS.max_batch_backlog if band == "batch" else DEFAULTS.max_backlog
    share = backlog_share(whole, DEFAULTS.tenant_backlog_share)
    assert admitted.tenant_max_queued == share
    assert max(admitted.max_backlog, admitted.max_batch_backlog) == max(
        DEFAULTS.max_backlog, DEFAULTS.max_batch_backlog
    )


def test_an_own_max_queued_under_an_explicit_grant_is_kept_as_set() -> None:
    config = TenantConfig(tenant="t", limits=TenantLimits(max_queued=5000), own_limits=TenantLimits(max_queued=4000))
    assert admission(DEFAULTS, Caller(tenant="t", config=config), "normal", shards=1).tenant_max_queued == 4000
