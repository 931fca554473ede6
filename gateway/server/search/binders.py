"""The gateway's client for the binders' internal API (search, webhook replay). Every
binder can answer; the first that does is used."""

from __future__ import annotations

import logging
from typing import Any

import httpx

from gateway.server.api.errors import ApiError

log = logging.getLogger(__name__)

# A binder's refusals, passed on to the caller (the binder may name a finer code).
_CODES = {404: "not_found", 409: "no_webhook", 422: "invalid_query", 429: "replay_rate_limited"}


class BinderClient:
    def __init__(self, urls: list[str], http: httpx.AsyncClient) -> None:
        self.urls = urls
        self.http = http

    async def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        last_error = "no binder configured"
        for url in self.urls:
            try:
                response = await self.http.post(f"{url}{path}", json=body)
            except httpx.HTTPError as exc:
                last_error = f"{url}: {type(exc).__name__}"
                log.warning("binder %s did not answer: %s", url, exc)
                continue
            if response.status_code in _CODES:
                raise _refusal(response)
            if response.is_success:
                return response.json()
            last_error = f"{url}: HTTP {response.status_code}"
        raise ApiError(503, "binder_unavailable", f"no binder answered ({last_error})")

    async def nearest(self, space: str, vector: list[float], k: int, tenant: str | None) -> list[dict[str, Any]]:
        body = {"space": space, "vector": vector, "k": k, "tenant": tenant}
        return (await self._post("/search", body))["hits"]

    async def replay_webhook(self, request_id: str, tenant: str | None) -> dict[str, Any]:
        """Queue the webhook again: 409 `replay_pending` while a replay of it is pending,
        429 `replay_rate_limited` (with Retry-After) over the tenant's replays a minute."""
        return await self._post(f"/webhooks/{request_id}/replay", {"tenant": tenant})


def _refusal(response: httpx.Response) -> ApiError:
    code = _CODES[response.status_code]
    try:
        body = response.json()
        detail, code = body.get("detail", response.text), body.get("code") or code
    except (ValueError, AttributeError):
        detail = response.text
    retry_after = response.headers.get("retry-after")
    headers = {"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None
    return ApiError(response.status_code, str(code)[:64], str(detail)[:500], headers=headers)
