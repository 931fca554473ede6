"""Keys, tenants and usage. An admin key manages its own tenant (another tenant's keys,
settings and usage read as unknown, 404); an operator key manages every tenant, makes
operator keys and sees the replicas; any key reads its own tenant's usage (GET /usage).

PUT /admin/tenants/<t> sets the fields its body names and keeps the others (a body with
only limits leaves the webhook secrets and endpoint alone; `limits` member by member).
A tenant's grant (weight, priority band, limits) is an operator's alone: a tenant's admin
sets its own limits within the grant (its `limits` are stored as `own_limits`, each at
most the grant's), never its weight or band (403 `grant_operator_only`), never a limit
above the grant (403 `limit_over_grant`)."""

from __future__ import annotations

import time
from typing import Annotated, Any, NoReturn

from fastapi import APIRouter, Depends, Query, Request
from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.protocol import WebhookSpec
from gateway.protocol.records import replica_name
from gateway.protocol.webhook_secrets import secrets_problem, tenant_secrets
from gateway.server.api.errors import ApiError
from gateway.server.api.tenancy import Caller, admin, caller, manage, operator
from gateway.server.routing.load import LoadTracker, ReplicaLoad
from gateway.server.services import Services, services
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.config import LIMIT_NAMES, Priority, TenantConfig, TenantLimits
from gateway.server.tenants.keys import Role
from gateway.server.tenants.shares import queued_granted

router = APIRouter(tags=["Tenants"])

Tenant = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class NewKey(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tenant: Tenant
    role: Role = "user"
    name: str = Field(default="", max_length=128)


class TenantSettings(BaseModel):
    """What PUT /admin/tenants/<t> may set; what its body leaves out is kept as it is."""

    model_config = ConfigDict(extra="forbid", strict=True)
    # The grant: an operator's alone.
    weight: float = Field(default=1.0, gt=0, le=1000)
    priority: Priority = "normal"
    # An operator's: the grant; a tenant admin's: its own limits, within the grant.
    limits: TenantLimits = Field(default_factory=TenantLimits)
    # The tenant's own limits, within the grant (0: the grant's), whoever sets them.
    own_limits: TenantLimits = Field(default_factory=TenantLimits)
    # Standard Webhooks secrets that sign this tenant's webhooks, all of them (newest first;
    # two during a rotation). Empty: its secrets derived from the deployment's WEBHOOK_SECRETS
    # sign them (GET /admin/tenants/<t>/webhook-secret shows them).
    webhook_secrets: list[str] = Field(default_factory=list, max_length=4)
    # Where OpenAI-style webhook events of this tenant's /v1 objects go (background responses,
    # batches): an http(s) URL, checked as a request's webhook is; null: none are sent.
    openai_webhook_url: str | None = Field(default=None, max_length=2048)

    @field_validator("openai_webhook_url")
    @classmethod
    def _endpoint_is_a_url(cls, url: str | None) -> str | None:
        if url is not None:
            WebhookSpec(url=url)  # (raises ValueError, answered 422 naming the field)
        return url

    @field_validator("webhook_secrets")
    @classmethod
    def _secrets_can_sign(cls, secrets: list[str]) -> list[str]:
        problem = secrets_problem(secrets)  # (never quotes a secret: the error is answered)
        if problem:
            raise ValueError(problem)
        return secrets


def _operator_key(role: Role) -> NoReturn:
    raise ApiError(403, "operator_only", f"only an operator key manages {role} keys")


@router.post("/admin/keys", status_code=201, summary="Create an API key (shown once)")
async def create_key(body: NewKey, request: Request, who: Annotated[Caller, Depends(admin)]) -> dict[str, Any]:
    manage(who, body.tenant)
    if body.role == "operator" and not who.operator:
        _operator_key(body.role)
    svc = services(request)
    info, key = await svc.keys.create(
        body.tenant, body.role, body.name, max_keys=svc.settings.tenant_max_keys, redis=svc.redis
    )
    return {**info.public(), "key": key}


@router.get("/admin/keys", summary="List API keys (never the keys themselves)")
async def list_keys(
    request: Request, who: Annotated[Caller, Depends(admin)], tenant: Annotated[str | None, Query(max_length=64)] = None
) -> dict[str, Any]:
    if tenant is not None:
        manage(who, tenant)
    scope = tenant if who.operator else who.tenant  # an admin lists its own tenant's keys
    return {"keys": [k.public() for k in await services(request).keys.list(scope)]}


@router.delete("/admin/keys/{key_id}", summary="Revoke an API key")
async def revoke_key(key_id: str, request: Request, who: Annotated[Caller, Depends(admin)]) -> dict[str, Any]:
    keys = services(request).keys
    if not who.operator:
        found = await keys.get(key_id)
        if found is None or found.tenant != who.tenant:
            raise ApiError(404, "not_found", f"no key {key_id}")
        if found.role == "operator":
            _operator_key(found.role)
    if not await keys.revoke(key_id):
        raise ApiError(404, "not_found", f"no key {key_id}")
    return {"id": key_id, "revoked": True}


@router.get("/admin/tenants/{tenant}", summary="A tenant's weight and limits")
async def get_tenant(tenant: str, request: Request, who: Annotated[Caller, Depends(admin)]) -> dict[str, Any]:
    manage(who, tenant)
    return (await services(request).tenants.get(tenant)).public()


@router.put(
    "/admin/tenants/{tenant}",
    summary="Set a tenant's weight, limits, webhook secrets or OpenAI webhook endpoint (the rest is kept)",
)
async def put_tenant(
    tenant: Tenant, body: TenantSettings, request: Request, who: Annotated[Caller, Depends(admin)]
) -> dict[str, Any]:
    manage(who, tenant)
    fields = body.model_dump(include=body.model_fields_set)
    for group in ("limits", "own_limits"):
        if group in fields:
            fields[group] = getattr(body, group).model_dump(include=getattr(body, group).model_fields_set)
    svc = services(request)
    tenants = svc.tenants
    if not who.operator:
        current = await tenants.get(tenant, fresh=True)
        within_grant(current, fields, granted(svc.settings, current))
    return (await tenants.update(tenant, fields)).public()


def granted(settings: GatewaySettings, current: TenantConfig) -> dict[str, int]:
    """What each limit of the tenant's grant means, as a number (0: no limit): each as
    granted, but max_queued at 0 is the tenant's share of the backlogs, not none."""
    limits = current.limits
    meaning = {name: getattr(limits, name) for name in LIMIT_NAMES}
    meaning["max_queued"] = queued_granted(
        limits.max_queued, settings.max_backlog, settings.max_batch_backlog, settings.tenant_backlog_share
    )
    return meaning


def within_grant(current: TenantConfig, fields: dict[str, Any], grant: dict[str, int]) -> None:
    """A tenant admin's change, made to fit its grant: its `limits` are its own limits; each
    may tighten what the grant means (`grant`: granted()), or at 0 leave it, never exceed
    it. The weight and the band are the grant itself (ApiError 403 for either)."""
    for name in ("weight", "priority"):
        if name in fields:
            raise ApiError(
                403,
                "grant_operator_only",
                f"{name} is part of the tenant's grant, which only an operator key sets",
                details={"field": name},
            )
    own = {**fields.pop("limits", {}), **fields.get("own_limits", {})}
    for name in LIMIT_NAMES:
        most, wanted = grant[name], own.get(name, 0)
        if most and wanted > most:
            raise ApiError(
                403,
                "limit_over_grant",
                f"limits.{name} may be at most the tenant's grant, {most} (an operator key raises the grant)",
                details={"field": f"limits.{name}", "granted": most},
            )
    if own:
        fields["own_limits"] = own


@router.get("/admin/tenants/{tenant}/usage", summary="A tenant's usage by day")
async def tenant_usage(
    tenant: str,
    request: Request,
    who: Annotated[Caller, Depends(admin)],
    days: Annotated[int, Query(ge=1, le=90)] = 7,
) -> dict[str, Any]:
    manage(who, tenant)
    return await services(request).usage.read(tenant, days)


def load_tracker(svc: Services) -> LoadTracker | None:
    """The engine load the router scrapes from each replica's metrics (None: no router)."""
    router = svc.dispatcher.runner.router
    return router.loads if router is not None else None


def load_view(load: ReplicaLoad | None) -> dict[str, Any] | None:
    if load is None or not load.scraped_at:
        return None  # never scraped (unhealthy, or no metrics URL)
    return {
        "requests": load.load,  # the engine's requests plus what this gateway routed since the scrape
        "used_blocks": load.blocks,
        "max_blocks": load.max_blocks,
        "reused_blocks": load.reused_blocks,
        "pending": load.pending,
        "scraped_s_ago": round(max(0.0, time.monotonic() - load.scraped_at), 3),
    }


@router.get("/admin/replicas", tags=["Operations"], summary="The Triton replicas: health, requests in flight, load")
async def replicas(request: Request, who: Annotated[Caller, Depends(operator)]) -> dict[str, Any]:
    svc = services(request)
    loads = load_tracker(svc)
    return {
        "replicas": [
            {
                "url": replica.url,
                "name": replica_name(replica.url),  # as records name it
                "healthy": replica.healthy,
                "removed": replica.removed,
                "inflight": replica.inflight,
                "max_inflight": replica.max_inflight,
                "engine_limits": replica.engine_limits,
                "ready_models": sorted(replica.ready_models),
                "last_error": replica.last_error,
                "generation": replica.generation,
                "load": load_view(loads.loads.get(replica.url) if loads is not None else None),
            }
            for replica in list(svc.pool.replicas)
        ]
    }


@router.get("/usage", summary="Your tenant's usage by day: requests and tokens")
async def own_usage(
    request: Request, who: Annotated[Caller, Depends(caller)], days: Annotated[int, Query(ge=1, le=90)] = 7
) -> dict[str, Any]:
    return await services(request).usage.read(who.tenant, days)


@router.get("/admin/tenants/{tenant}/webhook-secret", summary="The secrets that verify a tenant's webhooks")
async def tenant_webhook_secret(
    tenant: str, request: Request, who: Annotated[Caller, Depends(admin)]
) -> dict[str, Any]:
    """A tenant without secrets of its own is signed with secrets derived from the
    deployment's WEBHOOK_SECRETS and its name, shown here (newest first; two during a
    rotation). Secrets the tenant set itself are never echoed: only how many."""
    manage(who, tenant)
    svc = services(request)
    own = (await svc.tenants.get(tenant, fresh=True)).webhook_secrets
    if own:
        return {"tenant": tenant, "source": "tenant", "count": len(own)}
    if not svc.settings.webhook_secrets:
        raise ApiError(
            409,
            "no_webhook_secret",
            f"no secret signs tenant {tenant}'s webhooks: the gateway has no WEBHOOK_SECRETS to derive one from; "
            f"set the tenant's own with PUT /admin/tenants/{tenant}",
        )
    secrets = list(tenant_secrets(svc.settings.webhook_secrets, tenant))
    return {"tenant": tenant, "source": "derived", "count": len(secrets), "secrets": secrets}
