"""The webhook delivery queue in Redis, spread over the shards: a tenant's deliveries live
in its shard, beside its requests (`{sN}:wh:…`, gateway.protocol.redis_keys). A delivery
is a hash `{sN}:wh:delivery:<id>` plus a place in the shard's `{sN}:wh:due` sorted set
(scored by its next attempt) while it has attempts to come. Senders claim due deliveries
from every shard with a lease, so a sender that dies loses nothing: the lease runs out and
another sender takes them. An attempt must end inside its lease (the sender gives each
one a deadline), or the lease runs out mid-attempt and the delivery is sent twice. A shard
where nothing was due is asked again after a backoff (up to IDLE_POLL_MAX_S, or sooner
when its next delivery falls due), and at once after this process queued one there.

A delivery refers to what it sends instead of holding it: a request's webhook names the
request and its event, and the sender makes the body from the result record as MongoDB
holds it when it sends (request_payload). Deliveries are queued only once the record is
stored (the archiver stores, then queues; a replay starts from the stored record), and a
record the sender cannot read is an attempt that failed and is retried, never a body
sent without it. Only the thin OpenAI-style events below are held as they are.

Once delivered, or ended for good (gone, refused, out of attempts), a delivery's hash
stays WEBHOOK_KEEP_S (its attempts log, for looking into it; a request's is also in its
MongoDB document) and then expires; queuing the same delivery again meanwhile is a no-op.

Replays (asked for through the API) are limited per tenant, in a fixed window
(`{sN}:wh:replays:<tenant>`), and a request has at most one replay pending:
`{sN}:wh:replaying:<request id>` names its last replay, pending while it is still due.

A tenant holds at most its share of a sender's slots: a claim leases a tenant's due
deliveries only while it has allowance left (binder/webhooks/sender.py, TenantSlots), and
defers the rest behind the other tenants' (CLAIM), so a tenant at its share, or backed off
for a receiver that keeps stalling, delays nobody else's webhooks.

Deliveries queued before they moved into the shards (`{wh}:…`, where each held its whole
payload) are still claimed and sent from there.

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
import logging
import math
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from redis.asyncio import Redis

from gateway.common.redis import REDIS_OUTAGE
from gateway.common.webhooks import ENQUEUE, TENANT_ENDPOINT, openai_event
from gateway.protocol import TERMINAL_EVENT, ResultRecord, State
from gateway.protocol.records import DEFAULT_TENANT
from gateway.protocol.redis_keys import LEGACY_WEBHOOKS, WebhookSlot, all_shards, webhook_slot

log = logging.getLogger(__name__)

# Time kept at the end of a lease for recording the attempt's outcome.
LEASE_MARGIN_S = 1.0
# How long a delivery's hash stays after its final outcome (WEBHOOK_KEEP_S).
KEEP_S = 3600.0
# A slot where nothing was due is asked again after this long, doubled each time it is
# still idle, up to IDLE_POLL_MAX_S.
IDLE_POLL_S = 0.2
IDLE_POLL_MAX_S = 2.0


# KEYS: the new delivery's hash, the due set, the request's replay marker, the tenant's
# replay counter (all in the tenant's shard). ARGV: as ENQUEUE, then the limit and its
# window (seconds). Returns {1, delivery id} (queued), {0, pending delivery id}, or
# {-1, seconds to wait}.
REPLAY = """
local pending = redis.call('GET', KEYS[3])
if pending and redis.call('ZSCORE', KEYS[2], pending) then return {0, pending} end
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
if used >= tonumber(ARGV[10]) then
  local ttl = redis.call('TTL', KEYS[4])
  if ttl < 0 then redis.call('EXPIRE', KEYS[4], ARGV[11]); ttl = tonumber(ARGV[11]) end
  return {-1, ttl}
end
if redis.call('INCR', KEYS[4]) == 1 then redis.call('EXPIRE', KEYS[4], ARGV[11]) end
redis.call('HSET', KEYS[1], 'request_id', ARGV[1], 'url', ARGV[2], 'event', ARGV[3], 'webhook_id', ARGV[5],
  'tenant', ARGV[8], 'at', ARGV[9], 'attempts', 0, 'log', '[]')
if ARGV[4] ~= '' then redis.call('HSET', KEYS[1], 'payload', ARGV[4]) end
redis.call('ZADD', KEYS[2], ARGV[6], ARGV[7])
redis.call('SET', KEYS[3], ARGV[7], 'EX', 7 * 86400)
return {1, ARGV[7]}
"""

# KEYS: the due set. ARGV: now, how many, the lease's end, the deliveries' key prefix, how
# many due deliveries to look at, a tenant's allowance where it is not named, when a
# deferred delivery falls due again; then per named tenant: its name, its allowance, when
# its deferred deliveries fall due ('': as above). Leases the due deliveries of tenants
# with allowance left (in due order); those of a tenant with none left are deferred,
# behind the others'. A delivery that names no tenant (or is gone) is leased, its sender
# looks at it. Returns {when the slot's next delivery falls due ('' when none), leased
# delivery ids...}.
CLAIM = """
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, ARGV[5])
local want, default = tonumber(ARGV[2]), tonumber(ARGV[6])
local left, later = {}, {}
for i = 8, #ARGV, 3 do
  left[ARGV[i]] = tonumber(ARGV[i + 1])
  if ARGV[i + 2] ~= '' then later[ARGV[i]] = ARGV[i + 2] end
end
local out = {}
for _, id in ipairs(due) do
  if #out >= want then break end
  local tenant = redis.call('HGET', ARGV[4] .. id, 'tenant')
  local n = tenant and (left[tenant] or default) or 1
  if n > 0 then
    if tenant then left[tenant] = n - 1 end
    redis.call('ZADD', KEYS[1], ARGV[3], id)
    out[#out + 1] = id
  else
    redis.call('ZADD', KEYS[1], later[tenant] or ARGV[7], id)
  end
end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
table.insert(out, 1, first[2] or '')
return out
"""

# Due deliveries a claim looks at beyond those it may lease (those of tenants at their share
# are deferred as they are passed over, so the next claim reaches further).
CLAIM_LOOKS_PAST = 256

# KEYS: the delivery's hash, the due set, the request's replay marker. ARGV: delivery id,
# attempts, log, the next attempt's time ('': the final outcome), seconds the hash stays
# after a final outcome. A final outcome takes the delivery out of the due set and lets
# its hash (and the replay marker naming it) expire. Returns 0 when the hash is gone.
SAVE = """
if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('ZREM', KEYS[2], ARGV[1]); return 0 end
redis.call('HSET', KEYS[1], 'attempts', ARGV[2], 'log', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
  return 1
end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
if redis.call('GET', KEYS[3]) == ARGV[1] then redis.call('EXPIRE', KEYS[3], ARGV[5]) end
return 1
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
class Allowance:
    """How many more deliveries each tenant may be leased by one claim: `left` per tenant
    named, `default` for any other. The due deliveries of a tenant with none left are
    deferred to `until` of it, else by defer_s: the other tenants' go first."""

    default: int
    left: dict[str, int] = field(default_factory=dict)
    until: dict[str, float] = field(default_factory=dict)
    defer_s: float = 1.0

    def took(self, tenant: str) -> None:
        self.left[tenant] = self.left.get(tenant, self.default) - 1

    def args(self, now: float) -> list[Any]:
        """CLAIM's ARGV from its sixth on."""
        named: list[Any] = []
        for tenant, left in self.left.items():
            named += [tenant, max(0, left), self.until.get(tenant, "")]
        return [self.default, now + self.defer_s, *named]


@dataclass
class Delivery:
    delivery_id: str
    request_id: str
    url: str
    event: str
    # None: a reference; the sender makes it from the stored record (request_payload).
    payload: str | None
    webhook_id: str
    attempts: int
    slot: WebhookSlot  # where it lives
    tenant: str = DEFAULT_TENANT  # whose secrets sign it
    at: str = ""  # when its event happened (ISO 8601): the timestamp of a payload made at send time
    log: list[dict[str, Any]] = field(default_factory=list)
    leased_until: float = 0.0  # epoch seconds; 0: not claimed


class WebhookQueue:
    def __init__(self, redis: Redis, lease_s: float = 60.0, *, shards: int = 1, keep_s: float = KEEP_S) -> None:
        """shards: REDIS_SHARDS (a tenant's deliveries go to its shard; senders claim from
        all of them, and from the legacy `{wh}` slot). keep_s: how long a delivery's hash
        stays after its final outcome."""
        self.redis = redis
        self.lease_s = lease_s
        self.shards = shards
        self.keep_s = max(1, math.ceil(keep_s))
        self.slots = [shard.webhooks for shard in all_shards(shards)] + [LEGACY_WEBHOOKS]
        self._asleep: dict[WebhookSlot, float] = {}  # slot -> not asked again before (epoch s)
        self._idle: dict[WebhookSlot, float] = {}  # slot -> its backoff now
        self._first = 0  # the slot the next claim starts with (each gets its turn first)
        self._enqueue = redis.register_script(ENQUEUE)
        self._replay = redis.register_script(REPLAY)
        self._claim = redis.register_script(CLAIM)
        self._save = redis.register_script(SAVE)

    async def enqueue(self, records: list[ResultRecord]) -> list[str]:
        """Deliveries for the records' terminal events, where the request asked for them, and
        the OpenAI-style events of background responses. Enqueuing the same record twice is
        a no-op while its deliveries' hashes last (the delivery ids are fixed)."""
        created = []
        for record in records:
            for new in (_NewDelivery.of(record), _NewDelivery.openai(record)):
                if new is None:
                    continue
                slot = webhook_slot(new.tenant, self.shards)
                if await self._enqueue(keys=[slot.delivery(new.base), slot.due], args=new.args(new.base)):
                    created.append(new.base)
                    self._wake(slot)
        return created

    async def replay(self, record: ResultRecord, *, per_minute: int) -> Replay:
        """Queue the record's webhook once more (a new delivery, the same webhook-id), unless
        a replay of it is still pending or its tenant has used its replays of the minute."""
        new = _NewDelivery.of(record)
        if new is None:
            return Replay()
        delivery_id = f"{new.base}:replay:{time.time_ns()}"
        slot = webhook_slot(record.tenant, self.shards)
        keys = [slot.delivery(delivery_id), slot.due, slot.replaying(record.request_id), slot.replays(record.tenant)]
        outcome, value = await self._replay(keys=keys, args=[*new.args(delivery_id), per_minute, REPLAY_WINDOW_S])
        if int(outcome) == 1:
            self._wake(slot)
            return Replay(queued=str(value))
        if int(outcome) == 0:
            return Replay(pending=str(value))
        return Replay(retry_after_s=max(1, int(value)))

    async def claim(self, limit: int, allowance: Allowance | None = None) -> list[Delivery]:
        """Up to `limit` due deliveries from the slots, each leased to this sender for
        lease_s, within each tenant's allowance (None: any); a slot asked lately and found
        idle waits for its turn. A slot whose Redis is away is skipped for now; only when
        every slot asked failed does claim raise."""
        allowance = allowance or Allowance(default=limit)
        deliveries: list[Delivery] = []
        failure: Exception | None = None
        asked = failed = 0
        count = len(self.slots)
        first, self._first = self._first, (self._first + 1) % count
        for i in range(count):
            if len(deliveries) >= limit:
                break
            slot = self.slots[(first + i) % count]
            if self._asleep.get(slot, 0.0) > time.time():
                continue
            asked += 1
            try:
                deliveries += await self._claim_from(slot, limit - len(deliveries), allowance)
            except REDIS_OUTAGE as exc:
                log.warning("claiming webhooks of %s failed: %s", slot.tag, exc)
                self._asleep[slot] = time.time() + IDLE_POLL_MAX_S
                failure, failed = exc, failed + 1
        if failure is not None and failed == asked:
            raise failure  # Redis is away altogether: the sender's supervisor reports it
        return deliveries

    async def _claim_from(self, slot: WebhookSlot, limit: int, allowance: Allowance) -> list[Delivery]:
        now = time.time()
        leased_until = now + self.lease_s
        args = [now, limit, leased_until, slot.delivery(""), limit + CLAIM_LOOKS_PAST, *allowance.args(now)]
        next_due, *ids = await self._claim(keys=[slot.due], args=args)
        if ids:
            self._wake(slot)
        else:
            idle = min(IDLE_POLL_MAX_S, self._idle.get(slot, IDLE_POLL_S / 2) * 2)
            self._idle[slot] = idle
            self._asleep[slot] = min(now + idle, float(next_due)) if next_due else now + idle
        deliveries = []
        for delivery_id in ids:
            h = await self.redis.hgetall(slot.delivery(delivery_id))
            if not h:
                await self.redis.zrem(slot.due, delivery_id)
                continue
            if h.get("tenant"):
                allowance.took(h["tenant"])  # (as CLAIM counted it: by the tenant the hash names)
            deliveries.append(
                Delivery(
                    delivery_id=delivery_id,
                    request_id=h["request_id"],
                    url=h["url"],
                    event=h["event"],
                    payload=h.get("payload"),
                    webhook_id=h["webhook_id"],
                    attempts=int(h["attempts"]),
                    slot=slot,
                    tenant=h.get("tenant") or _tenant_of_payload(h.get("payload") or ""),
                    at=h.get("at") or "",
                    log=json.loads(h.get("log") or "[]"),
                    leased_until=leased_until,
                )
            )
        return deliveries

    async def save_attempt(self, delivery: Delivery, next_at: float | None) -> None:
        """Record the attempt; schedule the next one, or end the delivery (next_at None):
        then its hash expires keep_s later."""
        slot = delivery.slot
        keys = [slot.delivery(delivery.delivery_id), slot.due, slot.replaying(delivery.request_id)]
        args = [delivery.delivery_id, delivery.attempts, json.dumps(delivery.log), next_at or "", self.keep_s]
        await self._save(keys=keys, args=args)
        if next_at is not None and self._asleep.get(slot, 0.0) > next_at:
            self._asleep[slot] = next_at  # asked again when the retry falls due

    def _wake(self, slot: WebhookSlot) -> None:
        """The slot is asked at the next claim (it has work)."""
        self._asleep.pop(slot, None)
        self._idle.pop(slot, None)


def request_payload(record: ResultRecord, event: str, at: str) -> str:
    """The body of a request's webhook: its event, when that happened, and the result record
    as stored (less the webhook's own status, which its attempts change)."""
    return json.dumps(
        {
            "type": f"request.{event}",
            "timestamp": at,
            "data": record.model_dump(mode="json", exclude={"webhook_attempts", "webhook_status"}),
        }
    )


@dataclass(frozen=True)
class _NewDelivery:
    """What a delivery of a record's terminal event is made of."""

    base: str  # the delivery id of the first delivery; a replay's adds `:replay:<ns>`
    request_id: str
    url: str
    event: str
    payload: str  # "": a reference to the stored record
    webhook_id: str
    tenant: str

    @classmethod
    def of(cls, record: ResultRecord) -> _NewDelivery | None:
        """None when the record asked for no webhook of how it ended."""
        event = TERMINAL_EVENT.get(record.status)
        if not record.webhook or event is None or event.value not in record.webhook.events:
            return None
        base = f"{record.request_id}:{event.value}"
        # The same webhook-id on every attempt and replay: receivers de-duplicate on it.
        webhook_id = "msg_" + hashlib.sha256(base.encode()).hexdigest()[:26]
        return cls(base, record.request_id, record.webhook.url, event.value, "", webhook_id, record.tenant)

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
        """ENQUEUE's ARGV (REPLAY's first nine), due now."""
        now = time.time()
        return [
            self.request_id,
            self.url,
            self.event,
            self.payload,
            self.webhook_id,
            now,
            delivery_id,
            self.tenant,
            datetime.fromtimestamp(now, UTC).isoformat(),
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
