"""The webhook delivery queue in Redis, all in the `{wh}` slot. A delivery is a hash
`{wh}:delivery:<id>` plus a place in the `{wh}:due` sorted set (scored by its next
attempt) while it has attempts to come. Senders claim due deliveries with a lease, so a
sender that dies loses nothing: the lease runs out and another sender takes them. An
attempt must end inside its lease (the sender gives each one a deadline), or the lease
runs out mid-attempt and the delivery is sent twice.

Replays (asked for through the API) are limited per tenant, in a fixed window
(`{wh}:replays:<tenant>`), and a request has at most one replay pending:
`{wh}:replaying:<request id>` names its last replay, pending while it is still due.

A background response of the OpenAI API (a record with metadata api=responses and
background=true) that ends also gets an OpenAI-style event for its tenant's OpenAI webhook
endpoint: response.completed, response.incomplete (it ran out of tokens), response.failed
(failed or expired) or response.cancelled, with the thin payload OpenAI sends
({"id": "evt_...", "object": "event", "type", "created_at", "data": {"id": "resp_..."}};
gateway/common/webhooks.py). The sender looks the endpoint up when it sends; a tenant
without one gets nothing."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from gateway.common.webhooks import ENQUEUE, TENANT_ENDPOINT, openai_event
from gateway.protocol import TERMINAL_EVENT, ResultRecord, State
from gateway.protocol.records import DEFAULT_TENANT
from gateway.protocol.redis_keys import WEBHOOK_DUE, webhook_key, webhook_replays_key

# Time kept at the end of a lease for recording the attempt's outcome.
LEASE_MARGIN_S = 1.0


# KEYS: the new delivery's hash, the due set, the request's replay marker, the tenant's
# replay counter. ARGV: as ENQUEUE, then the limit and its window (seconds).
# Returns {1, delivery id} (queued), {0, pending delivery id}, or {-1, seconds to wait}.
REPLAY = """
local pending = redis.call('GET', KEYS[3])
if pending and redis.call('ZSCORE', KEYS[2], pending) then return {0, pending} end
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
if used >= tonumber(ARGV[9]) then
  local ttl = redis.call('TTL', KEYS[4])
  if ttl < 0 then redis.call('EXPIRE', KEYS[4], ARGV[10]); ttl = tonumber(ARGV[10]) end
  return {-1, ttl}
end
if redis.call('INCR', KEYS[4]) == 1 then redis.call('EXPIRE', KEYS[4], ARGV[10]) end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'url', ARGV[2], 'event', ARGV[3], 'payload', ARGV[4],
  'webhook_id', ARGV[5], 'tenant', ARGV[8], 'attempts', 0, 'log', '[]')
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[7])
redis.call('SET', KEYS[3], ARGV[7], 'EX', 7 * 86400)
return {1, ARGV[7]}
"""

CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[2])
for i, id in ipairs(due) do redis.call('ZADD', KEYS[1], ARGV[3], id) end
return due
"""


# Replays are counted per tenant in windows of this length (a minute).
REPLAY_WINDOW_S = 60


@dataclass(frozen=True)
class Replay:
    """What a replay request did: queued a delivery, found one pending, or was over the
    tenant's limit (retry after that many seconds). All None: no webhook to replay."""

    queued: str | None = None
    pending: str | None = None
    retry_after_s: int | None = None


@dataclass
class Delivery:
    delivery_id: str
    request_id: str
    url: str
    event: str
    payload: str
    webhook_id: str
    attempts: int
    tenant: str = DEFAULT_TENANT  # whose secrets sign it
    log: list[dict[str, Any]] = field(default_factory=list)
    leased_until: float = 0.0  # epoch seconds; 0: not claimed


class WebhookQueue:
    def __init__(self, redis: Redis, lease_s: float = 60.0) -> None:
        self.redis = redis
        self.lease_s = lease_s
        self._enqueue = redis.register_script(ENQUEUE)
        self._replay = redis.register_script(REPLAY)
        self._claim = redis.register_script(CLAIM)

    async def enqueue(self, records: list[ResultRecord]) -> list[str]:
        """Deliveries for the records' terminal events, where the request asked for them, and
        the OpenAI-style events of background responses. Enqueuing the same record twice is
        a no-op (the delivery ids are fixed)."""
        created = []
        for record in records:
            for new in (_NewDelivery.of(record), _NewDelivery.openai(record)):
                if new is not None and await self._enqueue(
                    keys=[webhook_key(new.base), WEBHOOK_DUE], args=new.args(new.base)
                ):
                    created.append(new.base)
        return created

    async def replay(self, record: ResultRecord, *, per_minute: int) -> Replay:
        """Queue the record's webhook once more (a new delivery, the same webhook-id), unless
        a replay of it is still pending or its tenant has used its replays of the minute."""
        new = _NewDelivery.of(record)
        if new is None:
            return Replay()
        delivery_id = f"{new.base}:replay:{time.time_ns()}"
        keys = [
            webhook_key(delivery_id),
            WEBHOOK_DUE,
            replay_marker_key(record.request_id),
            webhook_replays_key(record.tenant),
        ]
        outcome, value = await self._replay(keys=keys, args=[*new.args(delivery_id), per_minute, REPLAY_WINDOW_S])
        if int(outcome) == 1:
            return Replay(queued=str(value))
        if int(outcome) == 0:
            return Replay(pending=str(value))
        return Replay(retry_after_s=max(1, int(value)))

    async def claim(self, limit: int) -> list[Delivery]:
        now = time.time()
        leased_until = now + self.lease_s
        ids = await self._claim(keys=[WEBHOOK_DUE], args=[now, limit, leased_until])
        deliveries = []
        for delivery_id in ids:
            h = await self.redis.hgetall(webhook_key(delivery_id))
            if not h:
                await self.redis.zrem(WEBHOOK_DUE, delivery_id)
                continue
            deliveries.append(
                Delivery(
                    delivery_id=delivery_id,
                    request_id=h["request_id"],
                    url=h["url"],
                    event=h["event"],
                    payload=h["payload"],
                    webhook_id=h["webhook_id"],
                    attempts=int(h["attempts"]),
                    tenant=h.get("tenant") or _tenant_of_payload(h["payload"]),
                    log=json.loads(h.get("log") or "[]"),
                    leased_until=leased_until,
                )
            )
        return deliveries

    async def save_attempt(self, delivery: Delivery, next_at: float | None) -> None:
        """Record the attempt; schedule the next one, or end the delivery (next_at None)."""
        key = webhook_key(delivery.delivery_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping={"attempts": delivery.attempts, "log": json.dumps(delivery.log)})
            if next_at is None:
                pipe.zrem(WEBHOOK_DUE, delivery.delivery_id)
                pipe.expire(key, 7 * 86400)
            else:
                pipe.zadd(WEBHOOK_DUE, {delivery.delivery_id: next_at})
            await pipe.execute()


def replay_marker_key(request_id: str) -> str:
    """The delivery id of the request's last replay (the binder's own name, in `{wh}`)."""
    return f"{{wh}}:replaying:{request_id}"


@dataclass(frozen=True)
class _NewDelivery:
    """What a delivery of a record's terminal event is made of."""

    base: str  # the delivery id of the first delivery; a replay's adds `:replay:<ns>`
    request_id: str
    url: str
    event: str
    payload: str
    webhook_id: str
    tenant: str

    @classmethod
    def of(cls, record: ResultRecord) -> _NewDelivery | None:
        """None when the record asked for no webhook of how it ended."""
        event = TERMINAL_EVENT.get(record.status)
        if not record.webhook or event is None or event.value not in record.webhook.events:
            return None
        base = f"{record.request_id}:{event.value}"
        payload = json.dumps(
            {
                "type": f"request.{event.value}",
                "timestamp": datetime.now(UTC).isoformat(),
                "data": record.model_dump(mode="json", exclude={"webhook_attempts", "webhook_status"}),
            }
        )
        # The same webhook-id on every attempt and replay: receivers de-duplicate on it.
        webhook_id = "msg_" + hashlib.sha256(base.encode()).hexdigest()[:26]
        return cls(base, record.request_id, record.webhook.url, event.value, payload, webhook_id, record.tenant)

    @classmethod
    def openai(cls, record: ResultRecord) -> _NewDelivery | None:
        """The OpenAI-style event of a background response that ended (None for any other
        record)."""
        labels = record.metadata
        if labels.get("api") != "responses" or labels.get("background") != "true":
            return None
        kind = response_event(record)
        if kind is None:
            return None
        finished = record.finished_at.timestamp() if record.finished_at else None
        base, webhook_id, payload = openai_event(kind, f"resp_{record.request_id}", finished)
        return cls(base, record.request_id, TENANT_ENDPOINT, kind, payload, webhook_id, record.tenant)

    def args(self, delivery_id: str) -> list[Any]:
        """ENQUEUE's ARGV (REPLAY's first eight), due now."""
        return [
            self.request_id,
            self.url,
            self.event,
            self.payload,
            self.webhook_id,
            time.time(),
            delivery_id,
            self.tenant,
        ]


def _tenant_of_payload(payload: str) -> str:
    """The tenant of a delivery queued before deliveries named theirs: the record's."""
    try:
        tenant = (json.loads(payload).get("data") or {}).get("tenant")
    except (ValueError, AttributeError):
        return DEFAULT_TENANT
    return tenant if isinstance(tenant, str) and tenant else DEFAULT_TENANT


def response_event(record: ResultRecord) -> str | None:
    """The OpenAI webhook event of a response that ended this way."""
    if record.status == State.SUCCEEDED:
        incomplete = (record.outputs or {}).get("finish_reason") == "length"
        return "response.incomplete" if incomplete else "response.completed"
    if record.status in (State.FAILED, State.EXPIRED):
        return "response.failed"
    if record.status == State.CANCELED:
        return "response.cancelled"
    return None
