"""Putting a delivery into the binder's webhook queue (binder/webhooks/queue.py), from the
binder or from a gateway, and the OpenAI-style events both send.

A delivery is the hash `{sN}:wh:delivery:<id>` plus its place in `{sN}:wh:due`, in the
shard of its tenant (REDIS_SHARDS: the deliveries spread over the shards as the requests
do), made once: the same delivery id again is a no-op while its hash lasts. It names what
it sends instead of holding it: the request's webhook (`request.*` events) refers to its
result record, which the sender reads from MongoDB when it sends; only the thin
OpenAI-style events (a few hundred bytes) are held as they are. The binder's senders
claim due deliveries from every shard, sign them with the tenant's secrets (Standard
Webhooks) and POST them.

OpenAI-style events (OpenAI's webhook events, thin payloads: the object's id only) go to the
tenant's OpenAI webhook endpoint (its `openai_webhook_url`, set with PUT
/admin/tenants/<t>), which the sender looks up when it sends: such deliveries carry the
address TENANT_ENDPOINT instead of a URL. Sent for background responses (the binder, as it
stores their results) and for batches (the gateway that ends them)."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from gateway.protocol.redis_keys import webhook_slot

# KEYS: the delivery's hash, its slot's due set. ARGV: request id, url, event, payload ("":
# a reference, the payload is made from the stored record when it is sent), webhook id,
# due at, delivery id, tenant, the event's time (ISO 8601). Returns 1 (queued) or 0
# (already there).
ENQUEUE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'url', ARGV[2], 'event', ARGV[3], 'webhook_id', ARGV[5],
  'tenant', ARGV[8], 'at', ARGV[9], 'attempts', 0, 'log', '[]')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'payload', ARGV[4]) end
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[7])
return 1
"""

# The address of a delivery to the tenant's OpenAI webhook endpoint, looked up at send time.
TENANT_ENDPOINT = "tenant:openai_webhook_url"

RESPONSE_EVENTS = ("response.completed", "response.failed", "response.cancelled", "response.incomplete")
BATCH_EVENTS = ("batch.completed", "batch.failed", "batch.cancelled", "batch.expired")


def openai_event(kind: str, object_id: str, created_at: float | None = None) -> tuple[str, str, str]:
    """(delivery id, webhook id, payload) of the OpenAI-style event `kind` about one object
    (a response or a batch). The ids are fixed for the object and event: sending it again is
    the same delivery, and receivers de-duplicate on the webhook id."""
    base = f"openai:{object_id}:{kind}"
    digest = hashlib.sha256(base.encode()).hexdigest()
    event: dict[str, Any] = {
        "id": f"evt_{digest[:32]}",
        "object": "event",
        "type": kind,
        "created_at": int(created_at if created_at is not None else time.time()),
        "data": {"id": object_id},
    }
    return base, f"wh_{digest[32:64]}", json.dumps(event)


async def enqueue_delivery(
    redis: Redis,
    *,
    shards: int,
    delivery_id: str,
    request_id: str,
    url: str,
    event: str,
    payload: str,
    webhook_id: str,
    tenant: str,
    due_at: float | None = None,
) -> bool:
    """Queue one delivery in its tenant's shard (of `shards`: REDIS_SHARDS), due now unless
    told; False if it was queued before. payload "": a reference to the request's stored
    record."""
    now = time.time()
    at = datetime.fromtimestamp(now, UTC).isoformat()
    args = [request_id, url, event, payload, webhook_id, due_at or now, delivery_id, tenant, at]
    slot = webhook_slot(tenant, shards)
    queued = await redis.eval(ENQUEUE, 2, slot.delivery(delivery_id), slot.due, *args)
    return bool(queued)


async def enqueue_openai_event(
    redis: Redis, tenant: str, kind: str, object_id: str, created_at: float | None = None, *, shards: int
) -> bool:
    """Queue an OpenAI-style event for the tenant's OpenAI webhook endpoint (request_id of
    the delivery: the object's id)."""
    delivery_id, webhook_id, payload = openai_event(kind, object_id, created_at)
    return await enqueue_delivery(
        redis,
        shards=shards,
        delivery_id=delivery_id,
        request_id=object_id,
        url=TENANT_ENDPOINT,
        event=kind,
        payload=payload,
        webhook_id=webhook_id,
        tenant=tenant,
    )
