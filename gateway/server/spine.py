"""A request's life in one place: the stages every request goes through, in the order it
lives them, as plain async functions. Read this module first; each stage says where its
details live.

    1. accept   validate and count the prompt's tokens (long inputs in a worker thread)
                -> answer an idempotent replay (nothing charged) -> charge the
                tenant's rate limits -> SUBMIT: queued durably in the tenant's shard, or
                started at once in this process when it has a free replica slot
    2. start    TAKE: the fair queue's next requests, as many as a process has free slots
                for, in one call
    3. run      guards (cancel asked, too many deliveries) -> route -> call the replica
                (dispatch/runner.py) -> relay tokens (EMIT, batched per shard by
                dispatch/relay.py); its lease kept meanwhile (RENEW, from a thread)
    4. finish   FINISH: every token event in the stream first, then the record, once.
                The other ends: cancel (CANCEL), expiry, a draining process handing its
                runs on (HANDOVER), a dead process's runs put first in line (RECLAIM)
    5. read     READ: the request, its record while Redis holds it, or where it waits

The spine is the only caller of the script layer (gateway.server.queue.jobs over the Lua
scripts of queue/scripts/). Its drivers: the API routes and the batch runner call
accept (Submitter) and read (results/reader.py); each process's dispatcher
(dispatch/dispatcher.py) calls start, run and finish for the runs it holds, the sweeper
expire and reclaim. The spine imports nothing above it: what it needs of its drivers (a
process that can start a run at once, the replica call) it is handed, as the protocols
below describe them. Each stage is a span of the request's trace (gateway.common.tracing)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import SpanKind

from gateway.common import tracing
from gateway.common.logs import bind_request_ids
from gateway.common.redis import NotReplicated, waits_for_redis
from gateway.protocol import ErrorInfo, ResultRecord, State, new_request_id
from gateway.protocol.http import InferRequest
from gateway.protocol.redis_keys import Shard, band_for
from gateway.server import submission as checks
from gateway.server.errors import Busy, Conflict, Forbidden, LostPieces
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue import scripts
from gateway.server.queue.jobs import Emitted, Job, JobStore, NewRequest, QueueStanding, TokenEvent, inputs_delta
from gateway.server.settings import GatewaySettings
from gateway.server.submission import Submission
from gateway.server.tenants.caller import Caller
from gateway.server.tenants.quotas import Quotas

log = logging.getLogger(__name__)

# How long a finished run keeps trying to record its end while Redis is away, past its deadline.
FINISH_GRACE_S = 30.0


# -- 1. accept ----------------------------------------------------------------------------


class StartsRuns(Protocol):
    """A process that can start a request at once (the dispatcher)."""

    def can_start_now(self, model: str, tenant: str) -> tuple[str, bool]: ...
    def end_start_now(self, model: str) -> None: ...
    def adopt(self, job: Job, prepared: Any = None) -> None: ...
    def notice(self, shard: Shard, model: str) -> None: ...


@dataclass
class Submitter:
    """Stage 1 with this process's parts: what the API routes and the batch runner call."""

    settings: GatewaySettings
    registry: ModelRegistry
    jobs: JobStore
    quotas: Quotas
    starts: StartsRuns
    metrics: GatewayMetrics
    trace_id: Callable[[], str | None] = field(default=lambda: None)  # the call's X-Request-ID

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
        return await accept(self, who, [body], idempotency_keys=keys, batch=batch, extra_payload=extra_payload)

    async def submit_many(self, who: Caller, bodies: list[InferRequest], **options: Any) -> Submission:
        """Validate and queue requests of one model, all or none (accept's options)."""
        return await accept(self, who, bodies, **options)


@tracing.traced("accept")  # its stages' spans: gateway/common/tracing.py
async def accept(
    parts: Submitter,
    who: Caller,
    bodies: list[InferRequest],
    *,
    idempotency_keys: list[str] | None = None,
    batch: bool = False,
    extra_payload: dict[str, Any] | None = None,
    flex: bool = False,
) -> Submission:
    """Validate and queue requests of one model, all or none (flex: in the batch band).
    Several requests of one call (the inputs of /v1/embeddings, the n choices of a chat
    completion, a batch's lines) are admitted together and count as one call against the
    tenant's requests per minute; batch lines are paced by the batch window and backlog
    instead. Refusals are domain errors (gateway.server.errors)."""
    model = bodies[0].model
    if any(body.model != model for body in bodies):
        raise ValueError("one submission is for one model")
    registry, settings = parts.registry, parts.settings
    bodies = [checks.salted(registry, who, body) for body in bodies]
    with tracing.span("accept.tokenize"):
        prepared, prompt_tokens = await checks.prepare(registry, settings, bodies)
    hashes = [checks.body_hash(body) for body in bodies] if idempotency_keys else None
    if idempotency_keys and hashes:
        replay = await replayed(parts.jobs, who.tenant, idempotency_keys, hashes)
        if replay is not None:
            return replay
    band = band_for(bodies[0].priority, batch=batch or flex)
    if band == "high" and who.config.priority != "high" and not who.operator:
        raise Forbidden(
            "priority_not_granted",
            "priority above 0 (service_tier `priority` under /v1) runs ahead of every other tenant: "
            "it needs an operator's grant of the high band (the tenant's `priority`)",
            details={"field": "priority"},
        )
    admission = checks.admission(settings, who, band, len(parts.jobs.shards))
    checks.fits(admission, band, len(bodies))
    bodies = [checks.seeded(registry, body, item) for body, item in zip(bodies, prepared, strict=True)]
    now = time.time()
    shard = parts.jobs.shard_for(who.tenant)
    trace_id = parts.trace_id()
    carried = tracing.carrier()  # the trace's context, for whichever process runs it
    new: list[NewRequest] = []
    for index, (body, item, tokens) in enumerate(zip(bodies, prepared, prompt_tokens, strict=True)):
        timeout_s = body.timeout_s or settings.default_timeout_s
        payload = {
            "inputs": body.inputs,
            "parameters": body.parameters,
            "stream": body.stream,
            "webhook": body.webhook.model_dump() if body.webhook else None,
            # What the record keeps of the inputs, as a change to them (the inputs once).
            "stored_delta": inputs_delta(body.inputs, registry.adapters[model].stored_inputs(item)),
            "priority": body.priority,
            "metadata": body.metadata,
            "prompt_tokens": tokens,
            "trace_id": trace_id,  # the dispatcher and the binder log under it
            **carried,
            **(extra_payload or {}),
        }
        idempotency = (idempotency_keys[index], hashes[index]) if idempotency_keys and hashes else None
        new.append(NewRequest(new_request_id(now, shard.index), payload, now, now + timeout_s, idempotency))
    checks.fits_bytes(admission, sum(len(n.stored) for n in new))
    if not batch:
        with tracing.span("accept.quotas"):
            who.headers |= await parts.quotas.admit(who.config, sum(t or 0 for t in prompt_tokens) or 1)
    # SUBMIT, starting it at once where this process has room and nothing of the model waits.
    start_as, light_only = parts.starts.can_start_now(model, who.tenant) if len(new) == 1 else ("", False)
    charged = sum(t or 0 for t in prompt_tokens) if not batch else None
    try:
        with tracing.span("submit", SpanKind.PRODUCER):
            submitted = await parts.jobs.submit(
                new,
                model=model,
                tenant=who.tenant,
                band=band,
                admission=admission,
                start_as=start_as,
                light_only=light_only,
            )
    except NotReplicated:
        if charged is not None:
            await parts.quotas.refund(who.config, charged)
        raise
    finally:
        if start_as:
            parts.starts.end_start_now(model)  # the run, if started, is adopted below
    if charged is not None and submitted.outcome in ("full", "existing"):
        await parts.quotas.refund(who.config, charged)  # nothing was accepted: nothing is owed
    if submitted.outcome == "full":
        raise Busy(
            "backlog_full",
            f"{submitted.count} {checks.FULL.get(submitted.reason, 'requests are waiting')}; try again shortly",
            retry_after_s=settings.retry_after_s,
        )
    if submitted.outcome == "existing":  # submitted meanwhile by a concurrent call with the same key
        return checks.replay(submitted.existing, hashes or [])
    ids = [n.request_id for n in new]
    tracing.annotate("gateway.request_id", ids[0])
    bind_request_ids(trace_id=trace_id, request_id=ids[0])  # for the call's access line
    parts.metrics.count_accepted(model, len(ids))
    if submitted.outcome == "started":
        job = Job.started_at_once(new[0], model=model, tenant=who.tenant, band=band, run=submitted.run)
        parts.starts.adopt(job, prepared[0])  # validated once: the run does not do it again
    else:
        parts.starts.notice(shard, model)
    return Submission(ids, existing=False, started_here=submitted.outcome == "started")


async def replayed(jobs: JobStore, tenant: str, keys: list[str], hashes: list[str]) -> Submission | None:
    """The earlier submission with these Idempotency-Keys, answered before anything is charged."""
    found = [await jobs.idempotent(tenant, key) for key in keys]
    if all(f is None for f in found):
        return None
    if any(f is None for f in found):
        raise Conflict("idempotency_key_reused", "these Idempotency-Keys were used with other requests")
    return checks.replay([f for f in found if f is not None], hashes)


# -- 2. start -----------------------------------------------------------------------------


async def start_next(
    jobs: JobStore, shard: Shard, model: str, consumer: str, *, most: int = 1, light_only: bool
) -> list[Job] | str:
    """TAKE: start the fair queue's next requests of `model` in the shard for this
    consumer, up to `most` in one call (dispatch/scheduler.py tells the policy): the Jobs,
    each `run` its new run's token; or "empty", or "held" (only tenants outside the
    headroom wait)."""
    return await jobs.take_many(shard, model, consumer, most=most, light_only=light_only)


# -- 3. run -------------------------------------------------------------------------------


class RunsRequests(Protocol):
    """The replica call of a run (dispatch/runner.py): route, call, relay."""

    async def run(self, job: Job, control: Any, prepared: Any = None) -> ResultRecord: ...
    def partial(self, job: Job, control: Any, status: State, error: ErrorInfo | None) -> ResultRecord: ...


@tracing.of_job("run", queued=True, kind=SpanKind.CONSUMER)  # after a `start` span: the wait to start
async def run(
    runner: RunsRequests, job: Job, control: Any, prepared: Any, *, max_deliveries: int, on_acquired: Callable[[], None]
) -> ResultRecord:
    """Run a started request to its record: refused before any call when a cancel was
    asked or it was started too often (hand-overs do not count), cut at its deadline
    (what it produced is kept)."""
    if control.cancel_requested:
        return job.record(State.CANCELED)
    if job.deliveries > max_deliveries:
        return job.record(
            State.FAILED,
            error=ErrorInfo(code="too_many_attempts", message=f"started {job.deliveries - 1} times without finishing"),
        )
    control.on_acquired = on_acquired
    try:
        async with asyncio.timeout(max(0.0, job.deadline - time.time())):
            return await runner.run(job, control, prepared)
    except TimeoutError:
        control.stop()  # the Triton call is aborted on the way out
        error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed while it ran")
        return runner.partial(job, control, State.EXPIRED, error)


async def emit(jobs: JobStore, shard: Shard, events: list[TokenEvent]) -> list[Emitted]:
    """EMIT: token events of several runs of one shard, in one call (dispatch/relay.py
    gathers them)."""
    return await jobs.emit_many(shard, events)


def keep_leases(renew: Any, shard: Shard, consumer: str, lease_ms: int, runs: list[tuple[str, str]]) -> list[int]:
    """RENEW, from the lease keeper's thread (dispatch/leases.py) on its own connection:
    per (request id, run token) 1 still ours, 2 ours but asked to cancel, 0 stale, 3 ended
    (its own FINISH landed first: scripts.RENEW)."""
    keys, args = scripts.renew_call(shard, consumer, lease_ms, runs)
    return [int(flag) for flag in renew(keys=keys, args=args)]


# -- 4. finish ----------------------------------------------------------------------------


class TokenStream(Protocol):
    """A streamed run's token events (dispatch/emitter.py)."""

    @property
    def total(self) -> int: ...
    async def close(self, deadline: float) -> None: ...
    async def refill(self, deadline: float, *, emitted: int) -> None: ...


@tracing.of_job("finish")
async def finish(
    jobs: JobStore, job: Job, record: ResultRecord, emitter: TokenStream | None, *, output_event: bool
) -> str | None:
    """FINISH a run: every token event in the stream first, then the record, once;
    retried while Redis is away or full (both steps are idempotent), up to FINISH_GRACE_S
    past the deadline. The record's JSON, or None when the run was no longer current."""
    deadline = max(job.deadline, time.time()) + FINISH_GRACE_S
    delay = 0.05
    while True:
        try:
            if emitter is not None:
                await emitter.close(deadline)
            reply = await jobs.finish(
                record,
                run=job.run,
                output_event=output_event,
                emitted=emitter.total if emitter is not None else None,
            )
        except LostPieces as exc:
            log.error("request %s: %s", job.request_id, exc)
            emitter = None  # the record holds the whole text
            continue
        except Exception as exc:
            if not waits_for_redis(exc) or time.time() > deadline:
                raise
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)
            continue
        if isinstance(reply, int) and emitter is not None:
            await emitter.refill(deadline, emitted=reply)  # the stream has a gap: send it again
            continue
        return reply if isinstance(reply, str) else None


async def cancel(jobs: JobStore, request_id: str) -> State | None:
    """CANCEL: a queued request ends now; a running one is asked to stop (its dispatcher
    sees the flag). The state after the call, None if unknown."""
    return await jobs.cancel(request_id)


async def expire(jobs: JobStore, job: Job) -> bool:
    """End a request whose deadline passed before it ended (the sweeper); False when it
    ended meanwhile."""
    error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed before it ended")
    return await jobs.finish(job.record(State.EXPIRED, error=error), allowed=(job.state,)) is not None


async def hand_over(jobs: JobStore, consumer: str, runs: list[tuple[str, str]]) -> int:
    """HANDOVER: a draining process's runs, (request id, run token), go first in line for
    any other process at once."""
    return await jobs.handover(consumer, runs)


async def reclaim(jobs: JobStore, shard: Shard) -> int:
    """RECLAIM: runs whose lease ran out (their process died) go first in line."""
    return await jobs.reclaim(shard)


# -- 5. read ------------------------------------------------------------------------------


async def read(jobs: JobStore, request_id: str) -> tuple[Job | None, str | None, QueueStanding | None]:
    """READ: the request at one instant, with its record (JSON) while the results stream
    holds it, or where it stands when queued."""
    return await jobs.read(request_id)


async def load(jobs: JobStore, request_id: str) -> Job | None:
    """The request's state alone."""
    return await jobs.load(request_id)


async def load_many(jobs: JobStore, request_ids: list[str]) -> list[Job | Exception | None]:
    """The states of many requests, in one round trip (the sweeper's); a broken one is its
    parse error."""
    return await jobs.load_many(request_ids)


async def standing(jobs: JobStore, request_id: str) -> QueueStanding | None:
    """QUEUE: where a queued request stands (None when it is not queued)."""
    return await jobs.queue_position(request_id)


async def follow(jobs: JobStore, request_id: str, notice: bool) -> bool:
    """FOLLOW: an event hub follows the request's events; the scripts that write them
    name it in the shard's notices from now on, and with notice FOLLOW names it there
    now (a new follower: the hub's reader wakes to read it). False: the request is not there."""
    return await jobs.follow(request_id, notice=notice)


async def record_at(jobs: JobStore, shard: Shard, entry: str) -> str | None:
    """The record at an entry of the shard's results stream (gone once stored and trimmed)."""
    return await jobs.record_at(shard, entry)


async def final_record(jobs: JobStore, request_id: str) -> str | None:
    """The record of an ended request while the results stream still holds it."""
    return await jobs.final_record(request_id)
