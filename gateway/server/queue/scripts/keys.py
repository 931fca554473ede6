"""The keys each script receives in KEYS, in the order it reads them, and the one JSON
argument a script call's fields travel in (scripts/__init__.py: which keys are found as a
script runs)."""

from __future__ import annotations

import functools
import json
from typing import Any

from gateway.protocol.redis_keys import BANDS, Shard

# One encoder, made once: json.dumps with options of its own makes a new one each call.
# (The fields are plain dicts and lists built for the call: nothing to check for circles.)
_JSON = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, check_circular=False)


def script_json(fields: dict[str, Any]) -> str:
    """A script call's fields as its one JSON argument, which the script decodes
    (`cjson.decode`) and reads by name. Compact, its text as UTF-8 (not escaped: the script
    decodes fewer bytes and writes the text as it came). A field that is None is left out:
    cjson decodes null to `cjson.null`, which Lua takes for true, while a field left out is
    nil. Times go as strings (number_text): a Lua number keeps 14 digits when written back,
    and the scripts write them as they came."""
    return _JSON.encode({name: value for name, value in fields.items() if value is not None})


@functools.cache
def head_json(prefix: str, done: str = "") -> str:
    """The JSON head of a call made for many items (SUBMIT: its shard's prefix; FINISH: and
    the done channel), made once a shard."""
    return script_json({"prefix": prefix, "done": done or None})


def number_text(value: float) -> str:
    """A time as a script call's field: the text redis-py would send for it as an argument of
    its own (repr of a float, str of an int), which the script writes as it came."""
    return repr(value) if isinstance(value, float) else str(value)


# -- The keys, in the order the scripts read them from KEYS ------------------------------


def shard_keys(shard: Shard) -> list[str]:
    """KEYS[1..10] of SUBMIT, TAKE and FINISH: the shard's own keys (see _SHARD)."""
    return [
        shard.tenants,
        shard.running,
        shard.vclock,
        shard.backlog,
        shard.started,
        shard.leases,
        shard.deadlines,
        shard.results,
        shard.sync,
        shard.notices,
    ]


def model_keys(shard: Shard, model: str) -> list[str]:
    """KEYS[11..15] of TAKE (see _MODEL), and the first of a submission's keys in SUBMIT
    and of a request's in FINISH: the model's reclaimed list and its ready set in each band."""
    return [shard.reclaimed(model), *(shard.ready(model, band) for band in BANDS)]


def tenant_keys(shard: Shard, model: str, tenant: str) -> list[str]:
    """After model_keys in a submission's keys in SUBMIT and a request's in FINISH: the
    tenant's blocked set and its queue of the model in each band."""
    return [shard.blocked(tenant), *(shard.queue(model, band, tenant) for band in BANDS)]


def request_keys(shard: Shard, request_id: str) -> list[str]:
    """A request's hash, events and token ids (in this order)."""
    return [shard.request(request_id), shard.events(request_id), shard.tokens(request_id)]


def lease_keys(shard: Shard, request_ids: list[str]) -> list[str]:
    """KEYS of RENEW: the shard's leases, then each run's request hash."""
    return [shard.leases, *(shard.request(request_id) for request_id in request_ids)]


def reclaim_keys(shard: Shard) -> list[str]:
    """KEYS of RECLAIM: the shard's leases, deadlines and backlog counters."""
    return [shard.leases, shard.deadlines, shard.backlog]


def handover_keys(shard: Shard, request_ids: list[str]) -> list[str]:
    """KEYS of HANDOVER: those of RECLAIM, then each run's request hash."""
    return [*reclaim_keys(shard), *(shard.request(request_id) for request_id in request_ids)]


def finish_keys(shard: Shard, model: str, tenant: str, request_id: str) -> list[str]:
    """A request's part of FINISH's KEYS (13)."""
    return [*model_keys(shard, model), *tenant_keys(shard, model, tenant), *request_keys(shard, request_id)]


# Where a queued request stands: {its place in its tenant's queue, tenants ready in its
# band, how many of them go before its tenant in this round, tenants ready in higher
# bands plus requests reclaimed (they all go first), requests of its model TAKE started
# from the queue in the shard so far}. The request's model, band and tenant are read from its hash: the queue


def read_keys(shard: Shard, request_id: str) -> list[str]:
    """KEYS of READ and QUEUE."""
    return [shard.request(request_id), shard.results, shard.started]
