"""Each tenant's weight (its share under contention) and limits, in MongoDB's `tenants`
collection; a tenant without a document gets the defaults from settings, and so does each
limit its document does not set. Cached in every gateway and read again behind the
callers once a few seconds old (tenants/refreshing.py): a slow or absent MongoDB does not
slow or fail the requests of a tenant already known.

A change sets the fields it names and keeps the others (`update`): setting a tenant's
limits leaves its webhook secrets and endpoint alone, and setting one limit the others."""

from __future__ import annotations

from typing import Any

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


class TenantConfig(BaseModel):
    tenant: str
    weight: float = Field(default=1.0, gt=0, le=1000)
    limits: TenantLimits = Field(default_factory=TenantLimits)
    # Standard Webhooks secrets that sign this tenant's webhooks, all of them (else the
    # deployment's). The admin API checks them (gateway.protocol.webhook_secrets); the
    # binder reads them at send time (binder/webhooks/secrets.py).
    webhook_secrets: list[str] = Field(default_factory=list, max_length=4)
    # Where the OpenAI-style events of the tenant's /v1 objects go (response.completed for
    # background responses, batch.completed, ...), signed like its other webhooks; None: nowhere.
    openai_webhook_url: str | None = Field(default=None, max_length=2048)

    def public(self) -> dict[str, Any]:
        body = self.model_dump()
        body["webhook_secrets"] = len(self.webhook_secrets)  # how many, never the secrets
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

    async def get(self, tenant: str) -> TenantConfig:
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
        """Set the fields given (`limits` member by member), keep the others; returns the
        tenant's settings as they are now (read back from MongoDB, not from the cache)."""
        changes = {f"limits.{name}": value for name, value in (fields.get("limits") or {}).items()}
        changes.update({name: value for name, value in fields.items() if name not in ("limits", "tenant")})
        if changes:
            # ($set with upsert, not replace_one: the local MongoDB-wire server ignores an
            # upserting replace. One $set: concurrent changes of other fields are kept.)
            await self.collection.update_one({"_id": tenant}, {"$set": changes}, upsert=True)
        self._cache.drop(tenant)
        return await self.get(tenant)
