"""Which secrets sign a delivery: its tenant's own (`webhook_secrets` of the tenant's
document in MongoDB's `tenants` collection, set through PUT /admin/tenants/<t>), all of
them, so a receiver verifies during a rotation with either; else its derived secrets
(gateway.protocol.webhook_secrets.tenant_secrets: HMAC of each deployment WEBHOOK_SECRETS
over the tenant's name), never the deployment secret itself, which no tenant holds: one
tenant cannot sign a webhook another tenant's receiver accepts.

They are looked up at send time, so a rotation applies to the next attempt, retries
included, and kept per tenant for a few seconds. While MongoDB is out of reach the
secrets last read for a tenant still sign; a tenant not read before cannot be signed
for (never with a derived secret in its place): that attempt fails and is retried.
A stored tenant secret that cannot sign (stored before the admin API checked them) is
reported, never quoted, and the attempt refused. No secret is ever logged.

The same document holds the tenant's OpenAI webhook endpoint (`openai_webhook_url`), where
the OpenAI-style events of its /v1 objects go; it is read and kept with the secrets."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import PyMongoError

from gateway.protocol.webhook_secrets import secrets_problem, tenant_secrets

log = logging.getLogger(__name__)

# Tenants whose secrets are kept (least recently used dropped first).
MAX_TENANTS = 10_000


class SecretsUnavailable(Exception):
    """The tenant's secrets could not be read and none are known yet."""


@dataclass(frozen=True)
class Signing:
    """The secrets that sign one delivery, or why none can."""

    secrets: tuple[str, ...]
    owner: str  # "tenant" (its own secrets) or "derived" (from WEBHOOK_SECRETS and its name)
    problem: str | None = None  # a secret that cannot sign, described without quoting it


class TenantSecrets:
    def __init__(
        self,
        tenants: AsyncCollection | None,
        deployment: list[str],
        *,
        cache_s: float = 5.0,
        max_tenants: int = MAX_TENANTS,
    ) -> None:
        """tenants: the gateway's `tenants` collection (None: derived secrets only)."""
        self.tenants = tenants
        self.deployment = tuple(deployment)
        self.cache_s = cache_s
        self.max_tenants = max_tenants
        # tenant -> (read at, its webhook settings)
        self._known: OrderedDict[str, tuple[float, _TenantWebhooks]] = OrderedDict()

    async def endpoint(self, tenant: str) -> str | None:
        """The tenant's OpenAI webhook endpoint, if it set one."""
        if self.tenants is None:
            return None
        return (await self._tenant(tenant)).endpoint

    async def for_tenant(self, tenant: str) -> Signing:
        own = (await self._tenant(tenant)).secrets if self.tenants is not None else ()
        if not own:
            return Signing(tenant_secrets(self.deployment, tenant), "derived")
        problem = secrets_problem(list(own))
        if problem:
            problem = f"tenant {tenant}'s webhook {problem}; set valid ones with PUT /admin/tenants/{tenant}"
        return Signing(own, "tenant", problem)

    async def _tenant(self, tenant: str) -> _TenantWebhooks:
        now = time.monotonic()
        known = self._known.get(tenant)
        if known is not None and now - known[0] < self.cache_s:
            self._known.move_to_end(tenant)
            return known[1]
        assert self.tenants is not None
        try:
            document = await self.tenants.find_one({"_id": tenant}, {"webhook_secrets": 1, "openai_webhook_url": 1})
        except PyMongoError as exc:
            if known is None:
                raise SecretsUnavailable(f"the webhook secrets of tenant {tenant} cannot be read: {exc}") from None
            log.warning("reading the webhook secrets of tenant %s failed (%s); using the last known", tenant, exc)
            self._known[tenant] = (now, known[1])  # asked again after cache_s, not on every attempt
            return known[1]
        found = (document or {}).get("webhook_secrets") or []
        secrets = (
            (found,) if isinstance(found, str) else tuple(str(s) for s in found) if isinstance(found, list) else ()
        )
        url = (document or {}).get("openai_webhook_url")
        settings = _TenantWebhooks(secrets, url if isinstance(url, str) and url else None)
        self._known[tenant] = (now, settings)
        self._known.move_to_end(tenant)
        while len(self._known) > self.max_tenants:
            self._known.popitem(last=False)
        return settings


@dataclass(frozen=True)
class _TenantWebhooks:
    """What a tenant's document says about its webhooks."""

    secrets: tuple[str, ...] = ()
    endpoint: str | None = None  # its OpenAI webhook endpoint
