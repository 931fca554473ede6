"""Each tenant's grant and settings, in MongoDB's `tenants` collection: its weight (its
share under contention), the highest priority band it may ask for and its limits, all three
set by an operator (the grant); the limits its own admin set below the grant
(`own_limits`: a tenant may tighten its grant, never lift it); its webhook secrets and
endpoint. A tenant without a document gets the defaults from settings, and so does each
limit its document does not set. Cached in every gateway and read again behind the
callers once a few seconds old (tenants/refreshing.py): a slow or absent MongoDB does not
slow or fail the requests of a tenant already known.

A change sets the fields it names and keeps the others (`update`): setting a tenant's
limits leaves its webhook secrets and endpoint alone, and setting one limit the others."""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection

from gateway.protocol.records import TENANTS_COLLECTION
from gateway.server.tenants.refreshing import RefreshingCache

# Limits are stored as MongoDB int64 and passed to Lua (doubles): a billion is far beyond
# any real limit and well inside both.
LIMIT_MAX = 10**9
# Tenants whose settings a gateway keeps in memory.
MAX_CACHED_TENANTS = 100_000


class TenantLimits(BaseModel):
    """0 means no limit."""

    requests_per_minute: int = Field(default=0, ge=0, le=LIMIT_MAX)
    tokens_per_minute: int = Field(default=0, ge=0, le=LIMIT_MAX)
    max_concurrent: int = Field(default=0, ge=0, le=LIMIT_MAX)
    max_queued: int = Field(default=0, ge=0, le=LIMIT_MAX)


LIMIT_NAMES = tuple(TenantLimits.model_fields)
# The bands a grant may name, lowest first: `normal` allows the normal and low bands (and
# the batch band), `high` the high band too (POST /infer `priority > 0`, /v1
# `service_tier: "priority"`).
Priority = Literal["normal", "high"]


def tightest(grant: TenantLimits, own: TenantLimits) -> TenantLimits:
    """Each limit the lower of the two, where 0 means none."""
    values = {}
    for name in LIMIT_NAMES:
        a, b = getattr(grant, name), getattr(own, name)
        values[name] = min(a, b) if a and b else a or b
    return TenantLimits(**values)


class TenantConfig(BaseModel):
    tenant: str
    # The grant (an operator's alone): weight, the highest band, and the limits.
    weight: float = Field(default=1.0, gt=0, le=1000)
    priority: Priority = "normal"
    limits: TenantLimits = Field(default_factory=TenantLimits)
    # What the tenant's admin set within the grant (0: the grant's).
    own_limits: TenantLimits = Field(default_factory=TenantLimits)
    # Standard Webhooks secrets that sign this tenant's webhooks, all of them (else secrets
    # derived from the deployment's and the tenant: gateway.protocol.webhook_secrets
    # tenant_secrets). The admin API checks them (gateway.protocol.webhook_secrets); the
    # binder reads them at send time (binder/webhooks/secrets.py).
    webhook_secrets: list[str] = Field(default_factory=list, max_length=4)
    # Where the OpenAI-style events of the tenant's /v1 objects go (response.completed for
    # background responses, batch.completed, ...), signed like its other webhooks; None: nowhere.
    openai_webhook_url: str | None = Field(default=None, max_length=2048)

    @cached_property
    def effective(self) -> TenantLimits:
        """The limits that apply: the grant's, tightened by the tenant's own."""
        return tightest(self.limits, self.own_limits)

    def public(self) -> dict[str, Any]:
        body = self.model_dump()
        body["webhook_secrets"] = len(self.webhook_secrets)  # how many, never the secrets
        body["effective_limits"] = self.effective.model_dump()
        return body


class TenantStore:
    def __init__(
        self, client: AsyncMongoClient, database: str, defaults: TenantLimits, *, cache_s: float = 5.0
    ) -> None:
        self.collection: AsyncCollection = client[database][TENANTS_COLLECTION]
        self.defaults = defaults
        self.cache_s = cache_s
        self._cache: RefreshingCache[str, TenantConfig] = RefreshingCache(fresh_s=cache_s, maxsize=MAX_CACHED_TENANTS)

    def cached(self, tenant: str) -> TenantConfig | None:
        """What is known without a read (for the scheduler's hot path)."""
        return self._cache.peek(tenant)

    async def get(self, tenant: str, *, fresh: bool = False) -> TenantConfig:
        """The tenant's settings (fresh: read from MongoDB, not from the cache)."""
        if fresh:
            self._cache.drop(tenant)

        async def read() -> TenantConfig:
            document = await self.collection.find_one({"_id": tenant})
            if document is None:
                return TenantConfig(tenant=tenant, limits=self.defaults)
            limits = {**self.defaults.model_dump(), **(document.get("limits") or {})}
            return TenantConfig.model_validate({**document, "tenant": tenant, "limits": limits})

        config = await self._cache.get(tenant, read)
        assert config is not None  # read() always answers a config
        return config

    async def update(self, tenant: str, fields: dict[str, Any]) -> TenantConfig:
        """Set the fields given (`limits` and `own_limits` member by member), keep the others;
        returns the tenant's settings as they are now (read back from MongoDB, not from the
        cache). Who may set which field is the caller's to check (api/admin.py)."""
        members = ("limits", "own_limits")
        changes = {f"{group}.{name}": value for group in members for name, value in (fields.get(group) or {}).items()}
        changes.update({name: value for name, value in fields.items() if name not in (*members, "tenant")})
        if changes:
            # ($set with upsert, not replace_one: the local MongoDB-wire server ignores an
            # upserting replace. One $set: concurrent changes of other fields are kept.)
            await self.collection.update_one({"_id": tenant}, {"$set": changes}, upsert=True)
        self._cache.drop(tenant)
        return await self.get(tenant)
