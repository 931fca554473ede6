"""Who is calling: `Authorization: Bearer <API key>` (or Anthropic's `x-api-key: <API key>`)
names a key, the key a tenant and a role. Every object of a request belongs to the caller's
tenant; another tenant's objects read as unknown (404), so their existence does not leak.
A missing, wrong or revoked key is 401. With AUTH_ENABLED=false every caller is the default tenant, as an operator: the
settings allow it only with the gateway bound to loopback (local tools).

Admin calls: an `admin` key manages its own tenant only (another tenant reads as unknown,
404, like its other objects); an `operator` key manages every tenant and the deployment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request

from gateway.protocol.records import DEFAULT_TENANT
from gateway.server.api.errors import ApiError
from gateway.server.tenants.caller import Caller

_CHALLENGE = {"WWW-Authenticate": "Bearer"}

__all__ = ["Caller", "admin", "bearer", "caller", "identify", "manage", "operator"]

if TYPE_CHECKING:
    from gateway.server.services import Services


def bearer(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header."""
    scheme, _, token = (authorization or "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def identify(svc: Services, authorization: str | None, x_api_key: str | None = None) -> Caller:
    """Who makes a call with this Authorization header, else this x-api-key header (how
    Anthropic's clients send the key); ApiError 401 when nobody."""
    if not svc.settings.auth_enabled:
        return Caller(role="operator", config=await svc.tenants.get(DEFAULT_TENANT))
    token = bearer(authorization) or (x_api_key or "").strip() or None
    if token is None:
        raise ApiError(
            401,
            "missing_api_key",
            "send your API key as `Authorization: Bearer <key>` (or `x-api-key: <key>`)",
            headers=_CHALLENGE,
        )
    info = await svc.keys.verify(token)
    if info is None:
        raise ApiError(401, "invalid_api_key", "the API key is not valid (unknown or revoked)", headers=_CHALLENGE)
    return Caller(tenant=info.tenant, role=info.role, key_id=info.key_id, config=await svc.tenants.get(info.tenant))


async def caller(request: Request) -> Caller:
    """Who calls: as the edge found it from the headers before the body was read
    (gateway.server.api.edge), else (an app without the edge) from the key now."""
    known = getattr(request.state, "caller", None)
    if isinstance(known, Caller):
        return known
    from gateway.server.services import services

    who = await identify(services(request), request.headers.get("authorization"), request.headers.get("x-api-key"))
    request.state.caller = who  # the edge adds the headers its calls leave (x-ratelimit-*)
    return who


async def admin(request: Request) -> Caller:
    """An admin of its tenant, or an operator (what it may touch: `manage`)."""
    who = await caller(request)
    if who.role not in ("admin", "operator"):
        raise ApiError(403, "admin_only", "this call needs an admin key")
    return who


async def operator(request: Request) -> Caller:
    """An operator: calls about the deployment, not about one tenant."""
    who = await admin(request)
    if not who.operator:
        raise ApiError(403, "operator_only", "this call needs an operator key")
    return who


def manage(who: Caller, tenant: str) -> None:
    """An admin manages its own tenant only: another tenant reads as unknown (404), so its
    existence does not leak; an operator manages every tenant."""
    if not who.operator and tenant != who.tenant:
        raise ApiError(404, "not_found", f"no tenant {tenant}")
