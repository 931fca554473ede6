"""Who is calling: `Authorization: Bearer <API key>` names a key, the key a tenant and a
role. Every object of a request belongs to the caller's tenant; another tenant's objects
read as unknown (404), so their existence does not leak. A missing, wrong or revoked key
is 401. With AUTH_ENABLED=false every caller is the default tenant (local tools only)."""

from __future__ import annotations

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.protocol.records import DEFAULT_TENANT
from gateway.server.api.errors import ApiError
from gateway.server.tenants.caller import Caller

_CHALLENGE = {"WWW-Authenticate": "Bearer"}

__all__ = ["Caller", "CallerHeaders", "admin", "bearer", "caller"]


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


async def caller(request: Request) -> Caller:
    from gateway.server.services import services

    svc = services(request)
    if not svc.settings.auth_enabled:
        who = Caller(role="admin", config=await svc.tenants.get(DEFAULT_TENANT))
    else:
        token = bearer(request)
        if token is None:
            raise ApiError(
                401, "missing_api_key", "send your API key as `Authorization: Bearer <key>`", headers=_CHALLENGE
            )
        info = await svc.keys.verify(token)
        if info is None:
            raise ApiError(401, "invalid_api_key", "the API key is not valid (unknown or revoked)", headers=_CHALLENGE)
        who = Caller(tenant=info.tenant, role=info.role, key_id=info.key_id, config=await svc.tenants.get(info.tenant))
    request.state.caller = who
    return who


async def admin(request: Request) -> Caller:
    who = await caller(request)
    if who.role != "admin":
        raise ApiError(403, "admin_only", "this call needs an admin key")
    return who


class CallerHeaders:
    """Adds the headers calls made for the caller left (x-ratelimit-*) to its response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                who = scope.get("state", {}).get("caller")
                if who is not None and who.headers:
                    message["headers"] = [
                        *message.get("headers", []),
                        *((k.encode(), v.encode()) for k, v in who.headers.items()),
                    ]
            await send(message)

        await self.app(scope, receive, with_headers)
