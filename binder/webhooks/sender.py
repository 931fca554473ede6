"""Sending webhooks, from the binder (never from the request path).

Each POST is signed per the Standard Webhooks spec (webhook-id, webhook-timestamp,
webhook-signature; v1 HMAC-SHA256 with every configured `whsec_` secret, for rotation),
keeps the same webhook-id on every attempt, does not follow redirects, and goes only to
allowed addresses (guard.py). Failures are retried on a Svix-like schedule with jitter;
Retry-After is honoured; 410 Gone stops retries."""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks import Webhook

from binder.webhooks.guard import AddressGuard, Refused, pinned
from binder.webhooks.queue import Delivery, WebhookQueue

log = logging.getLogger(__name__)


def sign(secrets: list[str], webhook_id: str, timestamp: datetime, payload: str) -> str:
    """One v1 signature per secret, space-separated (receivers accept any one)."""
    return " ".join(Webhook(secret).sign(webhook_id, timestamp, payload) for secret in secrets)


def retry_after_seconds(value: str | None) -> float | None:
    if not value:
        return None
    if value.strip().isdigit():
        return float(value.strip())
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class WebhookSender:
    def __init__(
        self,
        queue: WebhookQueue,
        on_status: Any,
        *,
        secrets: list[str],
        retry_delays: list[float],
        jitter: float,
        timeout_s: float,
        concurrency: int,
        allowlist: list[str],
    ) -> None:
        """on_status(request_id, status, attempts_log) records the outcome (MongoDB)."""
        self.queue = queue
        self.on_status = on_status
        self.secrets = secrets
        self.retry_delays = retry_delays or [0.0]
        self.jitter = jitter
        self.guard = AddressGuard(allowlist)
        self.http = httpx.AsyncClient(timeout=timeout_s, follow_redirects=False)
        self.slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.http.aclose()

    async def run(self) -> None:
        if not self.secrets:
            log.warning("no WEBHOOK_SECRETS: webhooks cannot be signed and will not be sent")
        while True:
            free = self.concurrency - len(self.tasks)
            deliveries = await self.queue.claim(free) if free > 0 else []
            for delivery in deliveries:
                # Each delivery is its own task: a slow receiver holds one slot, not the queue.
                task = asyncio.create_task(self.deliver(delivery))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(0.05 if deliveries else 0.2)

    async def deliver(self, delivery: Delivery) -> None:
        async with self.slots:
            delivery.attempts += 1
            attempt: dict[str, Any] = {"at": datetime.now(UTC).isoformat(), "attempt": delivery.attempts}
            started = time.monotonic()
            status, retry_after = await self._post(delivery, attempt)
            attempt["duration_ms"] = round((time.monotonic() - started) * 1000, 1)
            delivery.log.append(attempt)
            next_at = self._next_attempt(delivery, status, retry_after)
            final = {"delivered": "delivered", "gone": "gone", "refused": "refused"}.get(status)
            outcome = final or ("retrying" if next_at is not None else "failed")
            await self.queue.save_attempt(delivery, None if final else next_at)
            await self.on_status(delivery.request_id, outcome, delivery.log)
            log.info("webhook %s attempt %d: %s", delivery.delivery_id, delivery.attempts, outcome)

    async def _post(self, delivery: Delivery, attempt: dict[str, Any]) -> tuple[str, float | None]:
        """('delivered' | 'gone' | 'refused' | 'error', Retry-After seconds)."""
        if not self.secrets:
            attempt["error"] = "no webhook secret configured"
            return "refused", None
        try:
            address = await self.guard.resolve(delivery.url)
        except Refused as exc:
            attempt["error"] = f"refused: {exc}"
            return "refused", None
        now = datetime.now(UTC)
        url, headers, extensions = pinned(delivery.url, address)
        headers.update(
            {
                "content-type": "application/json",
                "webhook-id": delivery.webhook_id,
                "webhook-timestamp": str(int(now.timestamp())),
                "webhook-signature": sign(self.secrets, delivery.webhook_id, now, delivery.payload),
                "user-agent": "triton-gateway-webhooks/1",
            }
        )
        try:
            response = await self.http.post(url, content=delivery.payload, headers=headers, extensions=extensions)
        except httpx.HTTPError as exc:
            attempt["error"] = f"{type(exc).__name__}: {exc}"
            return "error", None
        attempt["status_code"] = response.status_code
        if 200 <= response.status_code < 300:
            return "delivered", None
        if response.status_code == 410:
            return "gone", None
        return "error", retry_after_seconds(response.headers.get("retry-after"))

    def _next_attempt(self, delivery: Delivery, status: str, retry_after: float | None) -> float | None:
        if status != "error" or delivery.attempts >= len(self.retry_delays):
            return None
        delay = self.retry_delays[delivery.attempts] * random.uniform(1 - self.jitter, 1 + self.jitter)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return time.time() + delay
