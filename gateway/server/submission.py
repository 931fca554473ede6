"""Submitting requests: the use case behind POST /infer, the OpenAI routes and the batch
runner, below all of them.

    validate -> answer an idempotent replay (nothing charged) -> charge the tenant's rate
    limits -> queue durably in the tenant's shard, or start at once when this process has
    room -> hand to the dispatcher

Several requests of one call (the inputs of /v1/embeddings, the n choices of a chat
completion, the lines' inputs of a batch) are admitted together or not at all, and count as
one request against the tenant's requests per minute. Batch lines do not count against the
per-minute limits: the batch window and the batch backlog pace them. Flex requests (OpenAI's
service_tier flex) are queued in the batch band, below all interactive traffic, but are
charged like any other call. Refusals are domain errors (gateway.server.errors);
each API answers them in its own shape."""

from __future__ import annotations

import hashlib
import json
import math
import secrets
import time
from dataclasses import dataclass
from typing import Any

from gateway.common.logs import bind_request_ids
from gateway.protocol import State, new_request_id
from gateway.protocol.http import InferRequest
from gateway.protocol.redis_keys import band_for
from gateway.server.dispatch.dispatcher import Dispatcher
from gateway.server.errors import Busy, Conflict, InvalidRequest
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import InvalidInput, ModelRegistry
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.caller import Caller
from gateway.server.tenants.quotas import Quotas

_FULL = {
    "backlog": "requests are waiting",
    "batch": "batch requests are waiting",
    "bytes": "bytes of requests are waiting",
    "tenant": "of your requests are waiting",
}


@dataclass(frozen=True)
class Submission:
    request_ids: list[str]
    existing: bool  # an idempotent replay: the ids are those of the first submission
    # Started in this process by SUBMIT (its end cannot come before this call watches for it;
    # a queued one can be taken and ended by another process while the call still waits).
    started_here: bool = False

    @property
    def request_id(self) -> str:
        return self.request_ids[0]


def body_hash(body: InferRequest) -> str:
    canonical = json.dumps(body.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class Submitter:
    def __init__(
        self,
        settings: GatewaySettings,
        registry: ModelRegistry,
        jobs: JobStore,
        quotas: Quotas,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        trace_id: Any = lambda: None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.jobs = jobs
        self.quotas = quotas
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.trace_id = trace_id  # the submitting call's X-Request-ID, if any

    async def submit(
        self,
        who: Caller,
        body: InferRequest,
        *,
        idempotency_key: str | None = None,
        batch: bool = False,
        extra_payload: dict[str, Any] | None = None,
    ) -> Submission:
        """Validate and queue one request; its id (or, by idempotency key, the earlier one's)."""
        keys = [idempotency_key] if idempotency_key else None
        return await self.submit_many(who, [body], idempotency_keys=keys, batch=batch, extra_payload=extra_payload)

    async def submit_many(
        self,
        who: Caller,
        bodies: list[InferRequest],
        *,
        idempotency_keys: list[str] | None = None,
        batch: bool = False,
        extra_payload: dict[str, Any] | None = None,
        flex: bool = False,
    ) -> Submission:
        """Validate and queue requests of one model, all or none (flex: in the batch band)."""
        model = bodies[0].model
        if any(body.model != model for body in bodies):
            raise ValueError("one submission is for one model")
        settings = self.settings
        bodies = [self._salted(who, body) for body in bodies]
        prepared = [self._validate(body) for body in bodies]
        hashes = [body_hash(body) for body in bodies] if idempotency_keys else None
        if idempotency_keys and hashes:
            replay = await self._replayed(who, idempotency_keys, hashes)
            if replay is not None:
                return replay
        band = band_for(bodies[0].priority, batch=batch or flex)
        admission = self._admission(who, band)
        self._fits(admission, band, len(bodies))
        bodies = [self._seeded(body, item) for body, item in zip(bodies, prepared, strict=True)]
        prompt_tokens = [self._prompt_tokens(model, p) for p in prepared]
        if not batch:  # batch lines are paced by the batch window and backlog instead
            who.headers |= await self.quotas.admit(who.config, sum(t or 0 for t in prompt_tokens) or 1)
        now = time.time()
        shard = self.jobs.shard_for(who.tenant)
        new: list[NewRequest] = []
        for index, (body, item, tokens) in enumerate(zip(bodies, prepared, prompt_tokens, strict=True)):
            timeout_s = body.timeout_s or settings.default_timeout_s
            request_id = new_request_id(now, shard.index)
            payload = {
                "inputs": body.inputs,
                "parameters": body.parameters,
                "stream": body.stream,
                "webhook": body.webhook.model_dump() if body.webhook else None,
                "inputs_stored": self.registry.adapters[model].stored_inputs(item),
                "priority": body.priority,
                "metadata": body.metadata,
                "prompt_tokens": tokens,
                # The submitting call's X-Request-ID: the dispatcher and the binder log under it.
                "trace_id": self.trace_id(),
                **(extra_payload or {}),
            }
            idempotency = (idempotency_keys[index], hashes[index]) if idempotency_keys and hashes else None
            new.append(NewRequest(request_id, payload, now, now + timeout_s, idempotency))
        start_as, light_only = self.dispatcher.can_start_now(model, who.tenant) if len(new) == 1 else ("", False)
        try:
            submitted = await self.jobs.submit(
                new,
                model=model,
                tenant=who.tenant,
                band=band,
                admission=admission,
                start_as=start_as,
                light_only=light_only,
            )
        finally:
            if start_as:
                self.dispatcher.end_start_now(model)  # the run, if started, is adopted below
        if submitted.outcome == "full":
            raise Busy(
                "backlog_full",
                f"{submitted.count} {_FULL.get(submitted.reason, 'requests are waiting')}; try again shortly",
                retry_after_s=settings.retry_after_s,
            )
        if submitted.outcome == "existing":  # submitted meanwhile by a concurrent call with the same key
            return self._replay(submitted.existing, hashes or [])
        ids = [n.request_id for n in new]
        bind_request_ids(trace_id=self.trace_id(), request_id=ids[0])  # for the call's access line
        self.metrics.count_accepted(model, len(ids))
        if submitted.outcome == "started":
            first = new[0]
            job = Job(
                request_id=first.request_id,
                model=model,
                tenant=who.tenant,
                state=State.RUNNING,
                payload=first.payload,
                created_at=first.created_at,
                deadline=first.deadline,
                started_at=time.time(),
                attempts=1,
                emitted=0,
                cancel_requested=False,
                stored=False,
                band=band,
                run=submitted.run,
            )
            self.dispatcher.adopt(job, prepared[0])  # validated once: the run does not do it again
        else:
            self.dispatcher.notice(shard, model)
        return Submission(ids, existing=False, started_here=submitted.outcome == "started")

    def _validate(self, body: InferRequest) -> Any:
        try:
            adapter = self.registry.get(body.model)
            prepared = adapter.validate(body.inputs, body.parameters)
        except InvalidInput as exc:
            raise InvalidRequest(exc.code, exc.message, details=exc.details) from None
        timeout_s = body.timeout_s or self.settings.default_timeout_s
        if timeout_s > self.settings.max_timeout_s:
            raise InvalidRequest("timeout_too_long", f"timeout_s may be at most {self.settings.max_timeout_s:g}")
        return prepared

    def _salted(self, who: Caller, body: InferRequest) -> InferRequest:
        """The prefix cache is the tenant's own: its salt is the tenant, never the caller's
        choice (another tenant's name would open that tenant's cache)."""
        if "cache_salt" in body.parameters:
            raise InvalidRequest(
                "invalid_inputs", "parameters.cache_salt is set by the gateway (each tenant's cache is its own)"
            )
        adapter = self.registry.adapters.get(body.model)
        if adapter is None or not adapter.salted_cache:
            return body
        return body.model_copy(update={"parameters": {**body.parameters, "cache_salt": who.tenant}})

    def _seeded(self, body: InferRequest, prepared: Any) -> InferRequest:
        """A request that samples without a seed gets a fresh random one, stored with it:
        two such requests draw differently (the engines' default seed would make them the
        same), and a resumed run draws as the first did. (After the idempotency hash: the
        caller's body is what a replay compares.)"""
        adapter = self.registry.adapters[body.model]
        if not adapter.unseeded(prepared):
            return body
        seed = secrets.randbits(63)
        adapter.seed_with(prepared, seed)
        return body.model_copy(update={"parameters": {**body.parameters, "seed": seed}})

    def _prompt_tokens(self, model: str, prepared: Any) -> int | None:
        return self.registry.adapters[model].prompt_tokens(prepared)

    async def _replayed(self, who: Caller, keys: list[str], hashes: list[str]) -> Submission | None:
        """The earlier submission with these keys, answered before anything is charged."""
        found = [await self.jobs.idempotent(who.tenant, key) for key in keys]
        if all(f is None for f in found):
            return None
        if any(f is None for f in found):
            raise Conflict("idempotency_key_reused", "these Idempotency-Keys were used with other requests")
        return self._replay([f for f in found if f is not None], hashes)

    @staticmethod
    def _replay(existing: list[tuple[str, str]], hashes: list[str]) -> Submission:
        if [h for _, h in existing] != hashes:
            raise Conflict("idempotency_key_reused", "this Idempotency-Key was used with a different request body")
        return Submission([request_id for request_id, _ in existing], existing=True)

    def _admission(self, who: Caller, band: str) -> Admission:
        """The caps of the tenant's shard. The deployment's backlogs are split evenly between
        the shards, but a tenant lives in one shard: so a shard admits at least what one
        tenant may hold, whatever the shard count (the whole may then exceed MAX_BACKLOG by
        that much per shard). A tenant always keeps to its own max_queued; its share
        (tenant_backlog_share of its band class, interactive or batch) binds only while
        other tenants wait, so alone it may use the whole backlog; below
        tenant_backlog_reserve it is admitted even when the backlog is full, so no other
        tenant's flood or batch can lock it out."""
        s = self.settings
        limits = who.config.limits
        shards = len(self.jobs.shards)
        whole = s.max_batch_backlog if band == "batch" else s.max_backlog
        share = max(1, math.floor(whole * s.tenant_backlog_share))
        own = limits.max_queued or share
        backlog = math.ceil(s.max_backlog / shards)
        batch_backlog = math.ceil(s.max_batch_backlog / shards)
        if band == "batch":
            batch_backlog = max(batch_backlog, own)
        else:
            backlog = max(backlog, own)
        return Admission(
            max_backlog=backlog,
            max_batch_backlog=batch_backlog,
            max_bytes=math.ceil(s.max_backlog_bytes / shards),
            tenant_max_queued=limits.max_queued or 0,
            tenant_share=share if not limits.max_queued else 0,
            reserve=s.tenant_backlog_reserve,
            weight=who.config.weight,
            max_concurrent=limits.max_concurrent,
        )

    @staticmethod
    def _fits(admission: Admission, band: str, count: int) -> None:
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
