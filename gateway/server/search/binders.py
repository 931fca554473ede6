"""The gateway's client for the binders' internal API (search, webhook replay). Every
binder can answer; the first that does is used.

With INDEX_PARTITIONS > 1 the FAISS index is split by tenant: the i-th of BINDER_URLS
holds partition i % INDEX_PARTITIONS (a StatefulSet's binder-i), so a tenant's search
goes to the binders of its partition, and a search over every tenant to one binder of
each partition, their hits merged by score. Webhook replays go to any binder (the
queue is shared in Redis)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from gateway.common.settings import index_partition
from gateway.server.errors import Refused, Unavailable

log = logging.getLogger(__name__)

# A binder's refusals, passed on to the caller (the binder may name a finer code).
_CODES = {404: "not_found", 409: "no_webhook", 422: "invalid_query", 429: "replay_rate_limited"}


class BinderClient:
    def __init__(
        self, urls: list[str], http: httpx.AsyncClient, partitions: int = 1, api_key: str | None = None
    ) -> None:
        if partitions > len(urls):
            raise ValueError(f"INDEX_PARTITIONS={partitions} needs a binder of each: BINDER_URLS has {len(urls)}")
        self.urls = urls
        self.http = http
        self.partitions = max(1, partitions)
        # Per partition, the binders that hold it, in BINDER_URLS order.
        self.holders = [urls[p :: self.partitions] for p in range(self.partitions)]
        # The binders' BINDER_API_KEY (the http client is shared: the header goes per call).
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def _post(
        self, path: str, body: dict[str, Any] | None = None, urls: list[str] | None = None
    ) -> dict[str, Any]:
        last_error = "no binder configured"
        for url in self.urls if urls is None else urls:
            try:
                response = await self.http.post(f"{url}{path}", json=body, headers=self.headers)
            except httpx.HTTPError as exc:
                last_error = f"{url}: {type(exc).__name__}"
                log.warning("binder %s did not answer: %s", url, exc)
                continue
            if response.status_code in _CODES:
                raise _refusal(response)
            if response.is_success:
                return response.json()
            if response.status_code in (401, 403):
                log.error("binder %s refused the gateway (HTTP %d): check BINDER_API_KEY", url, response.status_code)
            last_error = f"{url}: HTTP {response.status_code}"
        raise Unavailable("binder_unavailable", f"no binder answered ({last_error})")

    async def nearest(self, space: str, vector: list[float], k: int, tenant: str | None) -> list[dict[str, Any]]:
        body = {"space": space, "vector": vector, "k": k, "tenant": tenant}
        if self.partitions == 1:
            return (await self._post("/search", body))["hits"]
        if tenant is not None:
            return (await self._post("/search", body, self.holders[index_partition(tenant, self.partitions)]))["hits"]
        answers = await asyncio.gather(*(self._post("/search", body, holders) for holders in self.holders))
        hits = [hit for answer in answers for hit in answer["hits"]]
        return sorted(hits, key=lambda hit: -float(hit["score"]))[:k]

    async def replay_webhook(self, request_id: str, tenant: str | None) -> dict[str, Any]:
        """Queue the webhook again: 409 `replay_pending` while a replay of it is pending,
        429 `replay_rate_limited` (with Retry-After) over the tenant's replays a minute."""
        return await self._post(f"/webhooks/{request_id}/replay", {"tenant": tenant})


def _refusal(response: httpx.Response) -> Refused:
    code = _CODES[response.status_code]
    try:
        body = response.json()
        detail, code = body.get("detail", response.text), body.get("code") or code
    except (ValueError, AttributeError):
        detail = response.text
    retry_after = response.headers.get("retry-after")
    headers = {"Retry-After": retry_after} if retry_after and retry_after.isdigit() else None
    return Refused(str(code)[:64], str(detail)[:500], headers=headers, status=response.status_code)
