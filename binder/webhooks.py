"""Webhook delivery, from the binder (never from the request path).

A delivery is a Redis hash `webhook:<id>` plus a place in the `webhooks:due` sorted set
(scored by its next attempt). Senders claim due deliveries with a lease, so a sender
that dies loses nothing: the lease runs out and another sender takes them.

Each POST is signed per the Standard Webhooks spec (webhook-id, webhook-timestamp,
webhook-signature; v1 HMAC-SHA256 with every configured `whsec_` secret, for rotation),
keeps the same webhook-id on every attempt, times out after 15 s, does not follow
redirects, and goes only to public addresses unless allowlisted (checked at send time,
and the connection goes to the address that was checked). Failures are retried on a
Svix-like schedule with jitter; Retry-After is honoured; 410 Gone stops retries."""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import ipaddress
import json
import logging
import random
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from redis.asyncio import Redis
from standardwebhooks import Webhook

from gateway.contracts import TERMINAL_EVENT, WEBHOOK_DUE_KEY, ResultRecord, webhook_key

log = logging.getLogger(__name__)

ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'url', ARGV[2], 'event', ARGV[3], 'payload', ARGV[4],
  'webhook_id', ARGV[5], 'attempts', 0, 'log', '[]')
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[7])
return 1
"""

CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for i, id in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[3], id) end
return due
"""


class Refused(Exception):
    """The URL resolves to an address we will not send to."""


@dataclass
class Delivery:
    delivery_id: str
    request_id: str
    url: str
    event: str
    payload: str
    webhook_id: str
    attempts: int
    log: list[dict[str, Any]] = field(default_factory=list)


class WebhookQueue:
    def __init__(self, redis: Redis, lease_s: float = 60.0) -> None:
        self.redis = redis
        self.lease_s = lease_s
        self._enqueue = redis.register_script(ENQUEUE)
        self._claim = redis.register_script(CLAIM)

    async def enqueue(self, records: list[ResultRecord], *, replay: bool = False) -> list[str]:
        """Deliveries for the records' terminal events, where the request asked for them.
        Enqueuing the same record twice is a no-op (the delivery id is fixed)."""
        created = []
        for record in records:
            event = TERMINAL_EVENT.get(record.status)
            if not record.webhook or event is None or event.value not in record.webhook.events:
                continue
            base = f"{record.request_id}:{event.value}"
            delivery_id = f"{base}:replay:{time.time_ns()}" if replay else base
            payload = json.dumps(
                {
                    "type": f"request.{event.value}",
                    "timestamp": datetime.now(timezone.utc).isoformat(),
                    "data": record.model_dump(mode="json", exclude={"webhook_attempts", "webhook_status"}),
                }
            )
            # The same webhook-id on every attempt and replay: receivers de-duplicate on it.
            webhook_id = "msg_" + hashlib.sha256(base.encode()).hexdigest()[:26]
            if await self._enqueue(
                keys=[webhook_key(delivery_id), WEBHOOK_DUE_KEY],
                args=[record.request_id, record.webhook.url, event.value, payload, webhook_id, time.time(), delivery_id],
            ):
                created.append(delivery_id)
        return created

    async def claim(self, limit: int) -> list[Delivery]:
        now = time.time()
        ids = await self._claim(keys=[WEBHOOK_DUE_KEY], args=[now, limit, now + self.lease_s])
        deliveries = []
        for delivery_id in ids:
            h = await self.redis.hgetall(webhook_key(delivery_id))
            if not h:
                await self.redis.zrem(WEBHOOK_DUE_KEY, delivery_id)
                continue
            deliveries.append(
                Delivery(
                    delivery_id=delivery_id, request_id=h["request_id"], url=h["url"], event=h["event"],
                    payload=h["payload"], webhook_id=h["webhook_id"], attempts=int(h["attempts"]),
                    log=json.loads(h.get("log") or "[]"),
                )
            )
        return deliveries

    async def save_attempt(self, delivery: Delivery, next_at: float | None) -> None:
        """Record the attempt; schedule the next one, or end the delivery (next_at None)."""
        key = webhook_key(delivery.delivery_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"attempts": delivery.attempts, "log": json.dumps(delivery.log)})
            if next_at is None:
                pipe.zrem(WEBHOOK_DUE_KEY, delivery.delivery_id)
                pipe.expire(key, 7 * 86400)
            else:
                pipe.zadd(WEBHOOK_DUE_KEY, {delivery.delivery_id: next_at})
            await pipe.execute()


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


class AddressGuard:
    """Decides, at send time, whether a URL's host may be contacted."""

    def __init__(self, allowlist: list[str]) -> None:
        self.hosts = set()
        self.networks = []
        for entry in allowlist:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower())

    async def resolve(self, url: str) -> str:
        """The address to connect to, or Refused."""
        parts = urlsplit(url)
        host = parts.hostname or ""
        port = parts.port or (443 if parts.scheme == "https" else 80)
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise Refused(f"cannot resolve {host}: {exc}") from None
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        if not addresses:
            raise Refused(f"{host} has no address")
        for address in addresses:
            if not self._allowed(host, address):
                raise Refused(f"{host} resolves to {address}, which is not a public address")
        return str(addresses[0])

    def _allowed(self, host: str, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if host.lower() in self.hosts or any(address in net for net in self.networks):
            return True
        mapped = getattr(address, "ipv4_mapped", None)
        return (mapped or address).is_global


def pinned(url: str, address: str) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The URL with its host replaced by the checked address, the Host header and TLS
    name to keep (so DNS cannot switch the address between check and connect)."""
    parts = urlsplit(url)
    host_ip = f"[{address}]" if ":" in address else address
    netloc = f"{host_ip}:{parts.port}" if parts.port else host_ip
    host_header = parts.netloc.rsplit("@", 1)[-1]
    extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
    return urlunsplit(parts._replace(netloc=netloc)), {"Host": host_header}, extensions


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
            attempt: dict[str, Any] = {"at": datetime.now(timezone.utc).isoformat(), "attempt": delivery.attempts}
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
        now = datetime.now(timezone.utc)
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
