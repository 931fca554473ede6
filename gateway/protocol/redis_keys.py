"""Redis names the gateway and the binder share.

Requests live in shards. A tenant's requests all live in one shard (`shard_for_tenant`),
and every key of a shard carries the shard's hash tag (`{s3}:...`), so each state change
is one Lua script over one Redis Cluster slot, and every per-tenant limit (queued,
running) and fairness decision is exact within that script. On a single Redis the same
names are used (REDIS_SHARDS=1: one shard). A request id carries its shard
(gateway.protocol.ids), so any process finds its keys from the id alone.

Per shard (prefix `{sN}:`):
- `req:<id>` hash (state, model, tenant, band, payload, attempts, handovers, emitted,
  owner, run (the current run's token: its fence), ...),
  `events:<id>` stream (what SSE and /v1 streams read), `tokens:<id>` (token ids emitted,
  for resuming on another replica);
- `q:<model>:<band>:<tenant>` list: the tenant's waiting requests, oldest first;
- `ready:<model>:<band>` sorted set: tenants with waiting work, scored by virtual time
  (weighted fair queuing; see gateway.server.dispatch.scheduler);
- `vclock` hash `<model>:<band>` -> virtual time; `tenants` hash tenant -> "weight limit";
  `blocked:<tenant>` set of `<model>:<band>` it left while at its concurrency limit;
- `reclaimed:<model>` list: running requests whose dispatcher died or handed them over,
  started again before anything else (their count is the backlog's `r:<model>`, which
  SUBMIT reads with the other counters);
- `leases` sorted set id -> lease end (ms, Redis's clock): a running request's dispatcher renews it;
- `deadlines` sorted set id -> deadline, for the sweeper: queued requests, and runs that
  lost their process (a run started at once is kept out until then); `backlog` and
  `running` counter hashes;
- `results` stream: finished records for the binders; `results:dead`: poison entries;
- `idem:<tenant>:<key>`: idempotency keys; `take:<consumer>`: a dispatcher's last take;
  `sync`: written by a replayed SUBMIT or FINISH, so the WAIT after it covers what it found;
- `wh:due`, `wh:delivery:<id>`, `wh:replaying:<request id>`, `wh:replays:<tenant>`: the
  webhook deliveries of the shard's tenants (binder/webhooks/queue.py).

`{wh}:` holds the webhook deliveries queued before they moved into the shards (senders
still drain it; nothing new goes there). Everywhere else: the pub/sub channels
(cluster-wide), usage, rate limits, the routing prefix index and `gateways` (the live
gateway processes, a sorted set by when each last said so: they split an engine's free
capacity) (single-key operations)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

from gateway.protocol.ids import MAX_SHARDS, request_id_shard

BANDS = ("high", "normal", "low", "batch")  # served in this order
GATEWAYS_KEY = "gateways"  # the live gateway processes (gateway.server.routing.load.GatewayPresence)

# -- pub/sub (cluster-wide) ---------------------------------------------------------------
DONE_CHANNEL = "done"  # '<id> <id> ...': requests a FINISH ended (each record is in its results entry)
CANCEL_CHANNEL = "cancel"  # '<id>' when a running request is asked to stop
WORK_CHANNEL = "work"  # '<shard prefix><model>' when work appears where there was none
KEYS_CHANNEL = "keys:changed"  # an API key was revoked (every process drops its cache)

# -- binder ----------------------------------------------------------------------------------
BINDER_GROUP = "binders"


@dataclass(frozen=True)
class WebhookSlot:
    """The key names of the webhook deliveries in one slot: a shard's (`{s3}:wh:`), or the
    one slot every delivery used to share (`{wh}:`, LEGACY_WEBHOOKS)."""

    tag: str  # the keys' common beginning, hash tag included

    @property
    def due(self) -> str:
        """Sorted set: delivery id -> its next attempt (or its lease's end), epoch seconds."""
        return f"{self.tag}due"

    def delivery(self, delivery_id: str) -> str:
        """Hash: what a delivery names (request id, url, event, webhook id, tenant), its attempts and log."""
        return f"{self.tag}delivery:{delivery_id}"

    def replaying(self, request_id: str) -> str:
        """String: the delivery id of the request's last replay."""
        return f"{self.tag}replaying:{request_id}"

    def replays(self, tenant: str) -> str:
        """Counter: the tenant's replays in the current window."""
        return f"{self.tag}replays:{tenant}"


# Where every delivery lived before they moved into the shards: drained, never added to.
LEGACY_WEBHOOKS = WebhookSlot("{wh}:")


def band_for(priority: int, *, batch: bool = False) -> str:
    if batch:
        return "batch"
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


def shard_for_tenant(tenant: str, shards: int) -> int:
    return zlib.crc32(tenant.encode()) % max(1, min(shards, MAX_SHARDS))


@dataclass(frozen=True)
class Shard:
    """The key names of one shard."""

    index: int

    @property
    def prefix(self) -> str:
        return f"{{s{self.index}}}:"

    def request(self, request_id: str) -> str:
        return f"{self.prefix}req:{request_id}"

    def events(self, request_id: str) -> str:
        return f"{self.prefix}events:{request_id}"

    def tokens(self, request_id: str) -> str:
        return f"{self.prefix}tokens:{request_id}"

    def queue(self, model: str, band: str, tenant: str) -> str:
        return f"{self.prefix}q:{model}:{band}:{tenant}"

    def ready(self, model: str, band: str) -> str:
        return f"{self.prefix}ready:{model}:{band}"

    def reclaimed(self, model: str) -> str:
        return f"{self.prefix}reclaimed:{model}"

    def idempotency(self, tenant: str, key: str) -> str:
        return f"{self.prefix}idem:{tenant}:{key}"

    def blocked(self, tenant: str) -> str:
        return f"{self.prefix}blocked:{tenant}"

    def take(self, consumer: str) -> str:
        return f"{self.prefix}take:{consumer}"

    @property
    def tenants(self) -> str:
        return f"{self.prefix}tenants"

    @property
    def vclock(self) -> str:
        return f"{self.prefix}vclock"

    @property
    def started(self) -> str:
        return f"{self.prefix}started"

    @property
    def sync(self) -> str:
        return f"{self.prefix}sync"

    @property
    def backlog(self) -> str:
        return f"{self.prefix}backlog"

    @property
    def running(self) -> str:
        return f"{self.prefix}running"

    @property
    def leases(self) -> str:
        return f"{self.prefix}leases"

    @property
    def deadlines(self) -> str:
        return f"{self.prefix}deadlines"

    @property
    def results(self) -> str:
        return f"{self.prefix}results"

    @property
    def notices(self) -> str:
        """Stream: the followed requests (field `followed` of their hash) whose events a
        script wrote, one entry a call (`ids`, space separated): what a process's event
        hub reads when it follows too many streams to name them all (results/events.py)."""
        return f"{self.prefix}notices"

    @property
    def results_dead(self) -> str:
        return f"{self.prefix}results:dead"

    @property
    def results_readers(self) -> str:
        """Hash: each binder's index follower -> "<last entry read> <ms>" (trimming waits for it)."""
        return f"{self.prefix}results:readers"

    @property
    def webhooks(self) -> WebhookSlot:
        """The webhook deliveries of the shard's tenants."""
        return WebhookSlot(f"{self.prefix}wh:")


def shard_of(request_id: str) -> Shard:
    return Shard(request_id_shard(request_id))


def all_shards(count: int) -> list[Shard]:
    return [Shard(i) for i in range(max(1, min(count, MAX_SHARDS)))]


def webhook_slot(tenant: str, shards: int) -> WebhookSlot:
    """Where a tenant's webhook deliveries live: in its shard, beside its requests."""
    return Shard(shard_for_tenant(tenant, shards)).webhooks
