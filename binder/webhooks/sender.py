"""Sending webhooks, from the binder (never from the request path).

Each POST is signed per the Standard Webhooks spec (webhook-id, webhook-timestamp,
webhook-signature; one v1 HMAC-SHA256 per current `whsec_` secret of the delivery's
tenant (its own, else those derived for it), so rotation works; secrets.py),
keeps the same webhook-id on every attempt, does not follow redirects, and goes only to
allowed addresses and ports (guard.py), never through a proxy named in the environment
(HTTP_PROXY and the like: the guard checked the destination, not a proxy). Failures are
retried on a Svix-like schedule with jitter; Retry-After is honoured up to
WEBHOOK_RETRY_AFTER_MAX_S and never past the delivery's expiry (RESULT_RETENTION_S after
its first attempt: the result it reports on is gone from MongoDB then), so a receiver
cannot park a delivery for ever; 410 Gone, a refused destination and a secret that cannot
sign end the delivery.

A request's webhook is made when it is sent: the delivery names the request, and its body
is the result record MongoDB holds then (queue.request_payload), read per attempt. A
record that cannot be read (MongoDB away, or not found) is an attempt that failed, retried
on the schedule: nothing is sent without it.

A tenant holds at most its share of the sender's slots (WEBHOOK_TENANT_SHARE of
WEBHOOK_CONCURRENCY, at least WEBHOOK_TENANT_FLOOR): while it holds them all, the other
tenants' due deliveries are claimed first and its own wait (queue.py, CLAIM). A tenant
whose attempts keep stalling (timed out, or failed after WEBHOOK_TENANT_SLOW_S) is backed
off: none of its deliveries are attempted for a while (doubled each time), then one at a
time until one is quick again (TenantSlots). Counted per sender process.

Every attempt ends in a recorded outcome, whatever goes wrong in it (a host name that
cannot be encoded, a resolver error, a bug): an attempt that raised without being
recorded would be claimed again when its lease ran out, every lease, for ever. Each
attempt also has a total deadline inside its lease, so a receiver that trickles its
answer cannot outlive the lease and get the delivery twice. Only the status line and
headers are awaited; the response body is never read.

An OpenAI-style event (its address is TENANT_ENDPOINT) goes to the tenant's OpenAI webhook
endpoint as it is when the attempt is made; a tenant without one gets nothing (the
delivery ends quietly). Its outcome is kept in the delivery only (WEBHOOK_KEEP_S after it
ends): a request's record shows the status of its own webhook."""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from standardwebhooks import Webhook

from binder.webhooks.guard import AddressGuard, Refused, Unresolvable, pinned
from binder.webhooks.queue import LEASE_MARGIN_S, Allowance, Delivery, WebhookQueue, request_payload
from binder.webhooks.secrets import SecretsUnavailable, TenantSecrets
from gateway.common.logs import bind_request_ids
from gateway.common.webhooks import TENANT_ENDPOINT
from gateway.protocol import ResultRecord

log = logging.getLogger(__name__)

# Reads a stored result record: (request id, tenant) -> the record, None if not stored.
RecordReader = Callable[[str, str | None], Awaitable[ResultRecord | None]]


def sign(secrets: list[str] | tuple[str, ...], webhook_id: str, timestamp: datetime, payload: str) -> str:
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


def retry_at(
    now: float, scheduled_s: float, retry_after_s: float | None, *, cap_s: float, expires_at: float | None
) -> float | None:
    """When the next attempt is due: the schedule's delay, or the receiver's Retry-After
    where that is longer, but a Retry-After counts for at most cap_s; and never after the
    delivery expires (None: it has expired, no attempt is left)."""
    delay = scheduled_s
    if retry_after_s is not None:
        delay = max(delay, min(retry_after_s, cap_s))
    if expires_at is None:
        return now + delay
    if now >= expires_at:
        return None
    return min(now + delay, expires_at)


def first_attempt_at(delivery: Delivery) -> float | None:
    """When the delivery's first attempt was made (epoch seconds; None before one was)."""
    try:
        return datetime.fromisoformat(delivery.log[0]["at"]).timestamp()
    except (IndexError, KeyError, TypeError, ValueError):
        return None


def trace_id_of(delivery: Delivery) -> str | None:
    """The X-Request-ID of the call that submitted the request (the record in the payload
    holds it), when it is one that is safe in a header line."""
    if delivery.payload is None:
        return None
    try:
        trace_id = (json.loads(delivery.payload).get("data") or {}).get("trace_id")
    except (ValueError, AttributeError):
        return None
    if isinstance(trace_id, str) and 0 < len(trace_id) <= 128 and trace_id.isascii() and trace_id.isprintable():
        return trace_id if " " not in trace_id else None
    return None


@dataclass(frozen=True)
class TenantShare:
    """A tenant's share of the sender's slots, and when a tenant whose receiver keeps
    stalling is backed off (WEBHOOK_TENANT_*)."""

    fraction: float = 0.25
    floor: int = 2
    # An attempt that fails after this long (or runs out of time) stalls its receiver.
    slow_s: float = 5.0
    # This many stalled attempts in a row back the tenant off for backoff_s, doubled each
    # time its next attempt stalls again, up to backoff_max_s.
    backoff_after: int = 3
    backoff_s: float = 30.0
    backoff_max_s: float = 900.0


class TenantSlots:
    """Each tenant's slots in this sender: at most its share at once; a tenant whose
    attempts keep stalling (its receiver times out, or fails slowly) is backed off: none
    of its deliveries are attempted until the backoff ends, then one at a time until an
    attempt is quick again."""

    def __init__(self, concurrency: int, share: TenantShare, timeout_s: float) -> None:
        self.rules = share
        self.share = max(1, min(concurrency, max(share.floor, math.ceil(share.fraction * concurrency))))
        self.timeout_s = timeout_s
        self.busy: Counter[str] = Counter()
        self.stalls: Counter[str] = Counter()  # stalled attempts in a row
        self.backoffs: Counter[str] = Counter()  # backoffs since the last quick attempt
        self.paused_until: dict[str, float] = {}  # epoch seconds
        self.took_s: dict[str, float] = {}  # how long its attempts take (a moving average)

    def backed_off(self, tenant: str) -> bool:
        return self.stalls[tenant] >= self.rules.backoff_after

    def allowance(self, now: float | None = None) -> Allowance:
        """What one claim may lease of each tenant now. A tenant with nothing left has its
        due deliveries deferred until its backoff ends, or about when one of its attempts
        ends (then the claims look at it again)."""
        now = time.time() if now is None else now
        allowance = Allowance(default=self.share)
        for tenant in set(self.busy) | {t for t in self.stalls if self.backed_off(t)}:
            room = self.share - self.busy[tenant]
            if self.backed_off(tenant):
                paused = self.paused_until.get(tenant, 0.0)
                room = 0 if paused > now else min(room, 1 - self.busy[tenant])
                if paused > now:
                    allowance.until[tenant] = paused
            allowance.left[tenant] = max(0, room)
            if room <= 0 and tenant not in allowance.until:
                took = self.took_s.get(tenant, 1.0)
                allowance.until[tenant] = now + min(max(took / 2, 0.5), self.timeout_s)
        return allowance

    def started(self, tenant: str) -> None:
        self.busy[tenant] += 1

    def ended(self, tenant: str, took_s: float, stalled: bool, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self.busy[tenant] -= 1
        if self.busy[tenant] <= 0:
            del self.busy[tenant]
        self.took_s[tenant] = took_s if tenant not in self.took_s else 0.8 * self.took_s[tenant] + 0.2 * took_s
        if not stalled:
            for kept in (self.stalls, self.backoffs, self.paused_until):
                kept.pop(tenant, None)
            return
        self.stalls[tenant] += 1
        # Attempts that began before a backoff and stall after it do not lengthen it.
        if self.backed_off(tenant) and self.paused_until.get(tenant, 0.0) <= now:
            pause = min(self.rules.backoff_max_s, self.rules.backoff_s * 2 ** self.backoffs[tenant])
            self.backoffs[tenant] += 1
            self.paused_until[tenant] = now + pause
            log.warning("webhooks of tenant %s: its receiver keeps stalling; backed off %.0fs", tenant, pause)


class WebhookSender:
    def __init__(
        self,
        queue: WebhookQueue,
        on_status: Any,
        *,
        records: RecordReader,
        secrets: TenantSecrets,
        retry_delays: list[float],
        jitter: float,
        timeout_s: float,
        concurrency: int,
        allowlist: list[str],
        retry_after_max_s: float = 3600.0,
        expire_after_s: float | None = None,
        tenant_share: TenantShare | None = None,
    ) -> None:
        """on_status(request_id, status, attempts_log) records the outcome (MongoDB).
        records: reads the stored result a request's webhook is made of (MongoDB).
        secrets: which secrets sign a tenant's deliveries. timeout_s bounds a whole
        attempt (and each network operation in it). retry_after_max_s: the longest
        Retry-After honoured; expire_after_s: how long after its first attempt a delivery
        expires (None: never). tenant_share: a tenant's share of the `concurrency` slots
        and its backoff (TenantSlots)."""
        self.queue = queue
        self.on_status = on_status
        self.records = records
        self.secrets = secrets
        self.retry_delays = retry_delays or [0.0]
        self.jitter = jitter
        self.timeout_s = timeout_s
        self.retry_after_max_s = retry_after_max_s
        self.expire_after_s = expire_after_s
        self.guard = AddressGuard(allowlist)
        # trust_env=False: no proxy (nor netrc credentials) from the environment; the guard
        # pinned the address this connection goes to. CA certificates named there
        # (SSL_CERT_FILE, SSL_CERT_DIR) still count.
        self.http = httpx.AsyncClient(
            timeout=timeout_s,
            follow_redirects=False,
            trust_env=False,
            verify=httpx.create_ssl_context(trust_env=True),
        )
        self.slots = asyncio.Semaphore(concurrency)
        self.concurrency = concurrency
        self.tenants = TenantSlots(concurrency, tenant_share or TenantShare(), timeout_s)
        self.tasks: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.http.aclose()

    async def run(self) -> None:
        if not self.secrets.deployment:
            log.warning("no WEBHOOK_SECRETS: webhooks of tenants without secrets of their own will not be sent")
        while True:
            free = self.concurrency - len(self.tasks)
            deliveries = await self.queue.claim(free, self.tenants.allowance()) if free > 0 else []
            for delivery in deliveries:
                # Each delivery is its own task: a slow receiver holds one slot, not the queue.
                self.tenants.started(delivery.tenant)
                task = asyncio.create_task(self._attempt(delivery))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            await asyncio.sleep(0.05 if deliveries else 0.2)

    async def _attempt(self, delivery: Delivery) -> None:
        """deliver(), its slot counted as its tenant's until it ends."""
        started, stalled = time.monotonic(), False
        try:
            stalled = await self.deliver(delivery)
        finally:
            self.tenants.ended(delivery.tenant, time.monotonic() - started, stalled)

    def deadline_s(self, delivery: Delivery) -> float:
        """How long this attempt may take: the timeout, cut short to end inside the lease."""
        if not delivery.leased_until:
            return self.timeout_s
        return max(0.0, min(self.timeout_s, delivery.leased_until - LEASE_MARGIN_S - time.time()))

    async def deliver(self, delivery: Delivery) -> bool:
        """Make one attempt and record it; whether it stalled its receiver (it failed after
        the tenant's slow_s, or ran out of time)."""
        bind_request_ids(trace_id=trace_id_of(delivery), request_id=delivery.request_id)  # in this delivery's task
        openai = delivery.url == TENANT_ENDPOINT
        if openai and not await self._resolve(delivery):
            return False
        async with self.slots:
            delivery.attempts += 1
            attempt: dict[str, Any] = {"at": datetime.now(UTC).isoformat(), "attempt": delivery.attempts}
            started = time.monotonic()
            deadline = self.deadline_s(delivery)
            timed_out = False
            try:
                async with asyncio.timeout(deadline):
                    status, retry_after = await self._post(delivery, attempt)
            except TimeoutError:
                attempt["error"] = f"no response within the attempt deadline of {deadline:.1f}s"
                status, retry_after = "error", None
                timed_out = True
            except Exception as exc:  # recorded, and retried on the schedule: never a silent loop
                log.warning("webhook %s attempt %d failed: %s", delivery.delivery_id, delivery.attempts, exc)
                attempt["error"] = f"{type(exc).__name__}: {exc}"[:500]
                status, retry_after = "error", None
            took = time.monotonic() - started
            attempt["duration_ms"] = round(took * 1000, 1)
            stalled = status == "error" and (timed_out or took >= self.tenants.rules.slow_s)
            delivery.log.append(attempt)
            next_at = self._next_attempt(delivery, status, retry_after)
            final = {"delivered": "delivered", "gone": "gone", "refused": "refused"}.get(status)
            outcome = final or ("retrying" if next_at is not None else "failed")
            try:
                await self.queue.save_attempt(delivery, None if final else next_at)
            except Exception as exc:  # Redis is down: the lease runs out and the attempt is made again
                log.warning("saving webhook %s attempt %d failed: %s", delivery.delivery_id, delivery.attempts, exc)
                return stalled
            log.info("webhook %s attempt %d: %s", delivery.delivery_id, delivery.attempts, outcome)
            if openai:
                return stalled
            try:
                await self.on_status(delivery.request_id, outcome, delivery.log)
            except Exception as exc:  # the attempt is saved in Redis; only the copy in MongoDB lags
                log.warning("recording webhook status of %s failed: %s", delivery.request_id, exc)
            return stalled

    async def _resolve(self, delivery: Delivery) -> bool:
        """Point an OpenAI-style event at its tenant's endpoint; False (and the delivery
        ended, or left to its lease while MongoDB is away) when there is none."""
        try:
            url = await self.secrets.endpoint(delivery.tenant)
        except SecretsUnavailable as exc:
            log.warning("webhook %s: %s; tried again when its lease runs out", delivery.delivery_id, exc)
            return False
        if url:
            delivery.url = url
            return True
        try:
            await self.queue.save_attempt(delivery, None)
        except Exception as exc:  # Redis is down: the lease runs out and it is looked at again
            log.warning("ending webhook %s failed: %s", delivery.delivery_id, exc)
        log.debug("webhook %s: tenant %s has no OpenAI webhook endpoint", delivery.delivery_id, delivery.tenant)
        return False

    async def _payload(self, delivery: Delivery, attempt: dict[str, Any]) -> str | None:
        """The body to send: the one the delivery holds, or one made from the stored record
        (None, the attempt's error said, when it cannot be read)."""
        if delivery.payload is not None:
            return delivery.payload
        try:
            record = await self.records(delivery.request_id, delivery.tenant)
        except Exception as exc:  # MongoDB away: retried on the schedule, like any failed attempt
            attempt["error"] = f"the stored result could not be read: {type(exc).__name__}: {exc}"[:500]
            return None
        if record is None:
            attempt["error"] = f"no stored result {delivery.request_id} to send"
            return None
        at = delivery.at or datetime.now(UTC).isoformat()
        delivery.payload = request_payload(record, delivery.event, at)
        return delivery.payload

    async def _post(self, delivery: Delivery, attempt: dict[str, Any]) -> tuple[str, float | None]:
        """('delivered' | 'gone' | 'refused' | 'error', Retry-After seconds)."""
        payload = await self._payload(delivery, attempt)
        if payload is None:
            return "error", None
        trace_id = trace_id_of(delivery)
        bind_request_ids(trace_id=trace_id, request_id=delivery.request_id)
        try:
            signing = await self.secrets.for_tenant(delivery.tenant)
        except SecretsUnavailable as exc:
            attempt["error"] = str(exc)[:500]
            return "error", None
        if signing.problem:
            attempt["error"] = f"refused: {signing.problem}"
            return "refused", None
        if not signing.secrets:
            attempt["error"] = "no webhook secret configured"
            return "refused", None
        try:
            target = await self.guard.resolve(delivery.url)
        except Refused as exc:
            attempt["error"] = f"refused: {exc}"
            return "refused", None
        except Unresolvable as exc:
            attempt["error"] = str(exc)
            return "error", None
        now = datetime.now(UTC)
        url, headers, extensions = pinned(delivery.url, target)
        headers.update(
            {
                "content-type": "application/json",
                "webhook-id": delivery.webhook_id,
                "webhook-timestamp": str(int(now.timestamp())),
                "webhook-signature": sign(signing.secrets, delivery.webhook_id, now, payload),
                "user-agent": "triton-gateway-webhooks/1",
            }
        )
        if trace_id:
            headers["x-request-id"] = trace_id  # receivers can match their logs to ours
        try:
            request = self.http.stream("POST", url, content=payload, headers=headers, extensions=extensions)
            async with request as response:  # closed unread: the status is all we need
                status_code, retry_after = response.status_code, response.headers.get("retry-after")
        except httpx.HTTPError as exc:
            attempt["error"] = f"{type(exc).__name__}: {exc}"
            return "error", None
        attempt["status_code"] = status_code
        if 200 <= status_code < 300:
            return "delivered", None
        if status_code == 410:
            return "gone", None
        return "error", retry_after_seconds(retry_after)

    def _next_attempt(self, delivery: Delivery, status: str, retry_after: float | None) -> float | None:
        if status != "error" or delivery.attempts >= len(self.retry_delays):
            return None
        delay = self.retry_delays[delivery.attempts] * random.uniform(1 - self.jitter, 1 + self.jitter)
        return retry_at(time.time(), delay, retry_after, cap_s=self.retry_after_max_s, expires_at=self.expiry(delivery))

    def expiry(self, delivery: Delivery) -> float | None:
        """When the delivery expires: expire_after_s after its first attempt."""
        first = first_attempt_at(delivery)
        return None if first is None or self.expire_after_s is None else first + self.expire_after_s
