"""What accepting a request checks and decides, below the accept stage
(gateway.server.spine): a body validated by its model, the tenant's salt on its prefix
cache, a seed where it samples without one, an idempotent replay answered from the
earlier submission, and the caps its shard admits it under. Refusals are domain errors
(gateway.server.errors); each API answers them in its own shape."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.protocol.http import InferRequest
from gateway.server.errors import Conflict, InvalidRequest
from gateway.server.models import InvalidInput, ModelRegistry
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.server.queue.jobs import Admission
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.caller import Caller
from gateway.server.tenants.shares import backlog_share

FULL = {  # what a full backlog is full of, by SUBMIT's reason
    "backlog": "requests are waiting",
    "batch": "batch requests are waiting",
    "bytes": "bytes of requests are waiting",
    "tenant": "of your requests are waiting",
    "tenant_bytes": "bytes of your requests are waiting",
}


@dataclass(frozen=True)
class Submission:
    request_ids: list[str]
    existing: bool  # an idempotent replay: the ids are those of the first submission
    # Started in this process by SUBMIT (its end cannot come before this call watches for it;
    # a queued one can be taken and ended by another process while the call still waits).
    started_here: bool = False
    # Each request's prompt tokens as the accept stage counted them (None: not counted here,
    # as for a replay, whose requests were counted by the call that made them).
    prompt_tokens: list[int | None] | None = None
    # A request started here for the call to carry in its own task (accept's carry_here):
    # awaited, it runs, finishes and delivers it, giving its record's JSON (None: not this
    # run's to finish). Whoever gets it must await it: the request is held for it.
    carry: Callable[[], Awaitable[str | None]] | None = None

    @property
    def request_id(self) -> str:
        return self.request_ids[0]


def body_hash(body: InferRequest) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


async def prepare(
    registry: ModelRegistry,
    settings: GatewaySettings,
    bodies: list[InferRequest],
    tenant: str | None,
    *,
    refuse: bool = True,
) -> tuple[list[Any], list[int | None]]:
    """Each body validated by its model (InvalidRequest otherwise), and its prompt's tokens
    where the model counts them; long inputs in the tokenize pool, in the tenant's share of
    it (refuse=False: never refused for it, as for a batch's lines; models.tokenize_pool)."""

    def work() -> tuple[list[Any], list[int | None]]:
        prepared = [validate(registry, settings, body) for body in bodies]
        tokens = [registry.adapters[b.model].prompt_tokens(p) for b, p in zip(bodies, prepared, strict=True)]
        return prepared, tokens

    return await off_the_loop_if_long([body.inputs for body in bodies], work, tenant=tenant, refuse=refuse)


def validate(registry: ModelRegistry, settings: GatewaySettings, body: InferRequest) -> Any:
    """The model's validated inputs (what its run uses), or InvalidRequest."""
    try:
        adapter = registry.get(body.model)
        prepared = adapter.validate(body.inputs, body.parameters)
    except InvalidInput as exc:
        raise InvalidRequest(exc.code, exc.message, details=exc.details) from None
    timeout_s = body.timeout_s or settings.default_timeout_s
    if timeout_s > settings.max_timeout_s:
        raise InvalidRequest("timeout_too_long", f"timeout_s may be at most {settings.max_timeout_s:g}")
    return prepared


def salted(registry: ModelRegistry, who: Caller, body: InferRequest) -> InferRequest:
    """The prefix cache is the tenant's own: its salt is the tenant, never the caller's
    choice (another tenant's name would open that tenant's cache)."""
    if "cache_salt" in body.parameters:
        raise InvalidRequest(
            "invalid_inputs", "parameters.cache_salt is set by the gateway (each tenant's cache is its own)"
        )
    adapter = registry.adapters.get(body.model)
    if adapter is None or not adapter.salted_cache:
        return body
    return body.model_copy(update={"parameters": {**body.parameters, "cache_salt": who.tenant}})


def seeded(registry: ModelRegistry, body: InferRequest, prepared: Any) -> InferRequest:
    """A request that samples without a seed gets a fresh random one, stored with it:
    two such requests draw differently (the engines' default seed would make them the
    same), and a resumed run draws as the first did. (After the idempotency hash: the
    caller's body is what a replay compares.)"""
    adapter = registry.adapters[body.model]
    if not adapter.unseeded(prepared):
        return body
    seed = secrets.randbits(63)
    adapter.seed_with(prepared, seed)
    return body.model_copy(update={"parameters": {**body.parameters, "seed": seed}})


def replay(existing: list[tuple[str, str]], hashes: list[str]) -> Submission:
    """The answer to a submission whose Idempotency-Keys were used before: the earlier
    requests, if the bodies are the same."""
    if [h for _, h in existing] != hashes:
        raise Conflict("idempotency_key_reused", "this Idempotency-Key was used with a different request body")
    return Submission([request_id for request_id, _ in existing], existing=True)


def admission(s: GatewaySettings, who: Caller, band: str, shards: int) -> Admission:
    """The caps of the tenant's shard, by requests and by bytes alike. The deployment's
    backlogs are split evenly between the shards, but a tenant lives in one shard: so a
    shard admits at least what one tenant may hold, whatever the shard count (the whole
    may then exceed MAX_BACKLOG by that much per shard). A tenant always keeps to its own
    max_queued; its share (tenant_backlog_share of its band class, interactive or batch,
    and of the bytes) binds only while other tenants wait, so alone it may use the whole
    backlog; below tenant_backlog_reserve requests and tenant_backlog_reserve_bytes bytes
    it is admitted even when the backlog is full, so no other tenant's flood or batch can
    lock it out."""
    limits = who.config.effective
    whole = s.max_batch_backlog if band == "batch" else s.max_backlog
    share = backlog_share(whole, s.tenant_backlog_share)
    queued = limits.max_queued
    if queued and not who.config.limits.max_queued:  # an own max_queued on the share's grant: within it
        queued = min(queued, share)
    own = queued or share
    backlog = math.ceil(s.max_backlog / shards)
    batch_backlog = math.ceil(s.max_batch_backlog / shards)
    if band == "batch":
        batch_backlog = max(batch_backlog, own)
    else:
        backlog = max(backlog, own)
    bytes_share = max(1, math.floor(s.max_backlog_bytes * s.tenant_backlog_share))
    return Admission(
        max_backlog=backlog,
        max_batch_backlog=batch_backlog,
        max_bytes=max(math.ceil(s.max_backlog_bytes / shards), bytes_share),
        tenant_max_queued=queued,
        tenant_share=share if not queued else 0,
        reserve=s.tenant_backlog_reserve,
        tenant_bytes_share=bytes_share,
        bytes_reserve=s.tenant_backlog_reserve_bytes,
        weight=who.config.weight,
        max_concurrent=limits.max_concurrent,
    )


def fits(admission: Admission, band: str, count: int) -> None:
    """Refuse a call that could never be admitted, however idle the system (a 429 would
    ask for retries that cannot succeed)."""
    most = admission.max_batch_backlog if band == "batch" else admission.max_backlog
    if admission.tenant_max_queued:
        most = min(most, admission.tenant_max_queued)
    if count > most:
        raise InvalidRequest(
            "too_many_requests_in_call",
            f"this call makes {count} requests; at most {most} of yours may wait at once",
            details={"requests": count, "max_queued": most},
        )


def fits_bytes(admission: Admission, size: int) -> None:
    """Refuse a call whose payloads could never be admitted by bytes, however idle the
    system: more than the shard admits and more than the tenant's reserve."""
    most = max(admission.max_bytes, admission.bytes_reserve)
    if size > most:
        raise InvalidRequest(
            "call_too_large",
            f"this call's requests hold {size} bytes as stored; at most {most} bytes of yours may wait at once",
            details={"bytes": size, "max_bytes": most},
        )
