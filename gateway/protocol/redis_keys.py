"""Redis names the gateway and the binder share: request hashes and event streams,
the request queues, the results stream, and the pub/sub channels."""

from __future__ import annotations

# -- Request queues -----------------------------------------------------------------------
# One stream per (model, band, tenant), read by the dispatchers' consumer group: a
# dispatcher reads only models it has free replica slots for, serves bands in order and
# tenants fairly within a band. `queue:streams` lists the queues (scored by last use).
DISPATCH_GROUP = "dispatchers"
QUEUE_REGISTRY = "queue:streams"
QUEUE_DEAD_LETTERS = "queue:dead"
BANDS = ("high", "normal", "low", "batch")  # served in this order


def queue_stream(model: str, band: str, tenant: str) -> str:
    return f"queue:{model}:{band}:{tenant}"


def parse_queue_stream(stream: str) -> tuple[str, str, str]:
    """(model, band, tenant) of a queue stream name."""
    _, model, band, tenant = stream.split(":", 3)
    return model, band, tenant


def band_for(priority: int, *, batch: bool = False) -> str:
    if batch:
        return "batch"
    return "high" if priority > 0 else "low" if priority < 0 else "normal"


# -- Requests -------------------------------------------------------------------------------
DEADLINES = "deadlines"  # sorted set: request id scored by its deadline
BACKLOG = "backlog"  # hash: accepted, not yet started: 'all', 't:<tenant>', 'm:<model>'
RUNNING = "running"  # hash: tenant -> requests running now (for per-tenant concurrency)
DONE_CHANNEL = "done"  # pub/sub: '<id>\n<record>' when a request ends
CANCEL_CHANNEL = "cancel"  # pub/sub: '<id>' when a running request is asked to stop


def request_key(request_id: str) -> str:
    return f"req:{request_id}"


def events_key(request_id: str) -> str:
    return f"events:{request_id}"


def idempotency_key(tenant: str, key: str) -> str:
    return f"idem:{tenant}:{key}"


# -- Results (dispatcher -> binders) ----------------------------------------------------------
RESULTS_STREAM = "results"
BINDER_GROUP = "binders"
RESULTS_DEAD_LETTERS = "results:dead"

# -- Webhooks (binder) ---------------------------------------------------------------------
WEBHOOK_DUE = "webhooks:due"  # sorted set: delivery id scored by next attempt time


def webhook_key(delivery_id: str) -> str:
    return f"webhook:{delivery_id}"
