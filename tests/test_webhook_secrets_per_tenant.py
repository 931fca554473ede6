"""Per-tenant webhook secrets: a tenant without secrets of its own is signed with a secret
derived from the deployment's WEBHOOK_SECRETS and its name (never the deployment secret
itself, which every such tenant would have to hold), shown to its admin by
GET /admin/tenants/<t>/webhook-secret. Tenant A's secret does not verify tenant B's
webhooks, so A cannot forge one B's receiver accepts."""

from __future__ import annotations

import base64
import hashlib
import hmac
import time
from dataclasses import replace
from datetime import UTC, datetime

import httpx
from standardwebhooks import Webhook

from gateway.protocol.webhook_secrets import secret_problem, tenant_secret, tenant_secrets
from tests import test_webhooks
from tests.conftest import AUTH, WEBHOOK_SECRET, webhook_secret_of
from tests.test_webhooks import Call, _new_secret, _path, _verifies, _webhook_status, _with_webhook

receiver = test_webhooks.receiver  # the recording HTTP receiver fixture, for this module too


def test_a_tenants_derived_secret_is_the_hmac_of_the_deployment_secret_over_its_name_in_whsec_form() -> None:
    key = base64.b64decode(WEBHOOK_SECRET.removeprefix("whsec_") + "==")
    expected = "whsec_" + base64.b64encode(hmac.new(key, b"acme", hashlib.sha256).digest()).decode()
    assert tenant_secret(WEBHOOK_SECRET, "acme") == expected
    assert secret_problem(expected) is None  # a Standard Webhooks secret: 32 bytes
    assert tenant_secret(WEBHOOK_SECRET, "acme") != tenant_secret(WEBHOOK_SECRET, "beta")
    assert WEBHOOK_SECRET not in (tenant_secret(WEBHOOK_SECRET, "acme"), tenant_secret(WEBHOOK_SECRET, ""))


def test_during_a_rotation_of_the_deployment_secrets_a_tenant_has_one_derived_secret_per_deployment_secret() -> None:
    new = "whsec_" + base64.b64encode(b"n" * 24).decode()
    assert tenant_secrets([new, WEBHOOK_SECRET], "acme") == (
        tenant_secret(new, "acme"),
        tenant_secret(WEBHOOK_SECRET, "acme"),
    )


async def _admin_of(stack, tenant: str) -> httpx.AsyncClient:
    """A client with a new admin key of tenant (made by the stack's operator key)."""
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=60) as operator:
        response = await operator.post("/admin/keys", json={"tenant": tenant, "role": "admin", "name": "secrets"})
        assert response.status_code == 201, response.text
    key = response.json()["key"]
    return httpx.AsyncClient(base_url=stack.gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


async def test_an_admin_is_shown_its_tenants_derived_webhook_secret_and_not_another_tenants(stack) -> None:
    tenant, other = f"whs-a-{time.time_ns()}", f"whs-b-{time.time_ns()}"
    async with await _admin_of(stack, tenant) as admin:
        shown = await admin.get(f"/admin/tenants/{tenant}/webhook-secret")
        elsewhere = await admin.get(f"/admin/tenants/{other}/webhook-secret")
    assert shown.status_code == 200, shown.text
    assert shown.json() == {
        "tenant": tenant,
        "source": "derived",
        "count": 1,
        "secrets": [webhook_secret_of(tenant)],
    }
    assert elsewhere.status_code == 404, elsewhere.text  # another tenant reads as unknown


async def test_a_tenant_with_its_own_secrets_is_shown_how_many_never_the_secrets(stack) -> None:
    tenant = f"whs-own-{time.time_ns()}"
    own = _new_secret()
    async with await _admin_of(stack, tenant) as admin:
        assert (await admin.put(f"/admin/tenants/{tenant}", json={"webhook_secrets": [own]})).status_code == 200
        shown = await admin.get(f"/admin/tenants/{tenant}/webhook-secret")
    assert shown.status_code == 200, shown.text
    assert shown.json() == {"tenant": tenant, "source": "tenant", "count": 1}
    assert own not in shown.text


async def test_tenant_a_cannot_forge_a_webhook_that_tenant_bs_receiver_accepts(stack, receiver) -> None:
    a, b = f"whs-forger-{time.time_ns()}", f"whs-victim-{time.time_ns()}"
    async with await _admin_of(stack, a) as admin_a:
        secret_a = (await admin_a.get(f"/admin/tenants/{a}/webhook-secret")).json()["secrets"][0]
    path = _path("victim")
    async with await _admin_of(stack, b) as admin_b:
        secret_b = (await admin_b.get(f"/admin/tenants/{b}/webhook-secret")).json()["secrets"][0]
        request_id = await _with_webhook(admin_b, receiver.url(path))
        await _webhook_status(admin_b, request_id, {"delivered"})
    [call] = receiver.to(path)
    assert _verifies(secret_b, call)  # what B's admin was shown verifies B's webhooks
    assert not _verifies(secret_a, call)
    assert not _verifies(WEBHOOK_SECRET, call)
    # What A can sign with its own secret, B's receiver refuses.
    forged = Webhook(secret_a).sign(call.headers["webhook-id"], _timestamp(call), call.body.decode())
    assert not _verifies(secret_b, _with_signature(call, forged))


def _timestamp(call: Call) -> datetime:
    return datetime.fromtimestamp(int(call.headers["webhook-timestamp"]), UTC)


def _with_signature(call: Call, signature: str) -> Call:
    return replace(call, headers={**call.headers, "webhook-signature": signature})
