"""Each tenant's weight (its share under contention) and limits, in MongoDB's `tenants`
collection; a tenant without a document gets the defaults from settings, and so does each
limit its document does not set. Cached for a few seconds in every gateway.

A change sets the fields it names and keeps the others (`update`): setting a tenant's
limits leaves its webhook secrets and endpoint alone, and setting one limit the others."""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, Field
from pymongo import AsyncMongoClient
from pymongo.asynchronous.collection import AsyncCollection
from pymongo.errors import PyMongoError

from gateway.protocol.records import TENANTS_COLLECTION

# Limits are stored as MongoDB int64 and passed to Lua (doubles): a billion is far beyond
# any real limit and well inside both.
LIMIT_MAX = 10**9


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
        self._cache: dict[str, tuple[float, TenantConfig]] = {}

    def cached(self, tenant: str) -> TenantConfig | None:
        """What is known without a read (for the scheduler's hot path)."""
        found = self._cache.get(tenant)
        return found[1] if found else None

    async def get(self, tenant: str) -> TenantConfig:
        now = time.monotonic()
        found = self._cache.get(tenant)
        if found is not None and now - found[0] < self.cache_s:
            return found[1]
        try:
            document = await self.collection.find_one({"_id": tenant})
        except PyMongoError:
            if found is not None:  # MongoDB is down: what was known still holds
                return found[1]
            raise
        if document is None:
            config = TenantConfig(tenant=tenant, limits=self.defaults)
        else:
            limits = {**self.defaults.model_dump(), **(document.get("limits") or {})}
            config = TenantConfig.model_validate({**document, "tenant": tenant, "limits": limits})
        self._cache[tenant] = (now, config)
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
        self._cache.pop(tenant, None)
        return await self.get(tenant)
