"""The webhook delivery queue in Redis. A delivery is a hash `webhook:<id>` plus a place
in the `webhooks:due` sorted set (scored by its next attempt). Senders claim due
deliveries with a lease, so a sender that dies loses nothing: the lease runs out and
another sender takes them. An attempt must end inside its lease (the sender gives each
one a deadline), or the lease runs out mid-attempt and the delivery is sent twice."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from gateway.protocol import TERMINAL_EVENT, ResultRecord
from gateway.protocol.redis_keys import WEBHOOK_DUE, webhook_key

# Time kept at the end of a lease for recording the attempt's outcome.
LEASE_MARGIN_S = 1.0

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
    leased_until: float = 0.0  # epoch seconds; 0: not claimed


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
                    "timestamp": datetime.now(UTC).isoformat(),
                    "data": record.model_dump(mode="json", exclude={"webhook_attempts", "webhook_status"}),
                }
            )
            # The same webhook-id on every attempt and replay: receivers de-duplicate on it.
            webhook_id = "msg_" + hashlib.sha256(base.encode()).hexdigest()[:26]
            if await self._enqueue(
                keys=[webhook_key(delivery_id), WEBHOOK_DUE],
                args=[
                    record.request_id,
                    record.webhook.url,
                    event.value,
                    payload,
                    webhook_id,
                    time.time(),
                    delivery_id,
                ],
            ):
                created.append(delivery_id)
        return created

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
