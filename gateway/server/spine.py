"""A request's life in one place: the stages every request goes through, in the order it
lives them, as plain async functions. Read this module first; each stage says where its
details live.

    1. accept   validate and count the prompt's tokens (long inputs in a worker thread)
                -> answer an idempotent replay (nothing charged) -> charge the
                tenant's rate limits -> SUBMIT: queued durably in the tenant's shard, or
                started at once in this process when it has a free replica slot
    2. start    TAKE: the fair queue's next requests, as many as a process has free slots
                for, in one call; the process holds each (a task, a slot, a lease) and
                its task carries it through 3 to 5 (`carry`)
    3. run      guards (cancel asked, too many deliveries) -> route -> call the replica,
                another one on a replica's failure (dispatch/runner.py) -> relay tokens
                (EMIT, batched per shard by dispatch/relay.py); its lease kept meanwhile
                (RENEW, from a thread). A run that breaks or whose process dies is run
                again elsewhere once its lease runs out (RECLAIM, first in line)
    4. finish   FINISH: every token event in the stream first, then the record, once
    5. deliver  the record to this process's waiters at once (other processes' learn it
                from FINISH's `done` message); this process's hooks for every end
    The other ends: cancel (CANCEL), a draining process handing its runs on (HANDOVER),
    and the sweeper's: a dead process's runs put first in line (RECLAIM), expiry.

Every change of a request's state goes through this module: it is the only caller of
the script layer's writes (gateway.server.queue.jobs over the Lua scripts of
queue/scripts/). Reads change nothing and are no stage: the readers (results/reader.py,
the event hub's FOLLOW, the API's state checks, the dispatcher's look at the backlog)
call JobStore's reads themselves. Its drivers: the API routes and the batch runner call
accept (Submitter) and cancel; each process's dispatcher (dispatch/dispatcher.py), which
owns only what a process has (its slots, its tasks, its leases' renewal), calls start,
carry and hand_over, its lease keeper keep_leases, its relay emit; the sweeper sweep.
The spine imports nothing above it: what it needs of its drivers (a process that holds
runs, the replica call, the waiters) it is handed, as the protocols below describe them.
Each stage is a span of the request's trace (gateway.common.tracing).

One request, one task (issue 61; counted by REQUEST_COUNTS, gateway.common.counts): a
`Prefer: wait` POST /infer that SUBMIT starts in this process is carried through 3 to 5
by the task that accepted it (accept's carry_here, the dispatcher's `hold`; its answer
is the record FINISH wrote: api/submit.py Carried), no task, future or read between.
What still crosses tasks, and why:
- grpc.aio makes a task of every call (UnaryUnaryCall._invoke), inside grpc;
- the dispatcher's tasks (`adopt`) carry the requests TAKEn from the queue, and those
  started at once for a call that does not wait for them (no wait, SSE, /v1, a batch);
  the notifier's futures wake this process's waiters for those, and for other
  processes' requests (their `done` message);
- past its wait, a carried call's 202 goes out from a task made then (the run goes on
  in the call's task);
- the group commit's sender task, for the script calls made while one is in flight (a
  call made while nothing is pending goes at once from its caller's task; a Redis write
  is bounded in the writer's task and a connection taken from the pool is checked
  without a turn of the loop: common/redis.py)."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry.trace import SpanKind
from redis.exceptions import NoScriptError

from gateway.common import tracing
from gateway.common.logs import bind_request_ids
from gateway.common.redis import REDIS_OUTAGE, NotReplicated, waits_for_redis
from gateway.protocol import ErrorInfo, ResultRecord, State, new_request_id
from gateway.protocol.http import InferRequest
from gateway.protocol.redis_keys import Shard, band_for
from gateway.server import submission as checks
from gateway.server.errors import Busy, Conflict, Forbidden, InvalidRequest, LostPieces, StaleRun
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue import scripts
from gateway.server.queue.jobs import Emitted, Job, JobStore, NewRequest, TokenEvent, inputs_delta
from gateway.server.settings import GatewaySettings
from gateway.server.submission import Submission
from gateway.server.tenants.caller import Caller
from gateway.server.tenants.quotas import Quotas

log = logging.getLogger(__name__)

# How long a finished run keeps trying to record its end while Redis is away, past its deadline.
FINISH_GRACE_S = 30.0
# Requests past their deadline a shard's sweep ends at most at once.
SWEEP_MOST = 200


# -- 1. accept ----------------------------------------------------------------------------


class StartsRuns(Protocol):
    """A process that holds runs (the dispatcher): it can start a request at once, and
    holds each request started for it (its task, its slot, its lease)."""

    consumer: str

    def can_start_now(self, model: str, tenant: str) -> tuple[str, bool]: ...
    def end_start_now(self, model: str) -> None: ...
    def adopt(self, job: Job, prepared: Any = None) -> None: ...
    def hold(self, job: Job, prepared: Any = None) -> Callable[[], Awaitable[str | None]] | None: ...
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
        carry_here: bool = False,
    ) -> Submission:
        """Validate and queue one request; its id (or, by idempotency key, the earlier one's).
        carry_here: the caller carries a request started at once in its own task
        (Submission.carry), which it then must await."""
        keys = [idempotency_key] if idempotency_key else None
        return await accept(
            self, who, [body], idempotency_keys=keys, batch=batch, extra_payload=extra_payload, carry_here=carry_here
        )

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
    carry_here: bool = False,
) -> Submission:
    """Validate and queue requests of one model, all or none (flex: in the batch band).
    Several requests of one call (the inputs of /v1/embeddings, the n choices of a chat
    completion, a batch's lines) are admitted together and count as one call against the
    tenant's requests per minute; batch lines are paced by the batch window and backlog
    instead. Refusals are domain errors (gateway.server.errors). carry_here: a request
    started at once is carried (run, finish, deliver) by the caller's task, which awaits
    Submission.carry, not by a task of the dispatcher's."""
    model = bodies[0].model
    if any(body.model != model for body in bodies):
        raise ValueError("one submission is for one model")
    registry, settings = parts.registry, parts.settings
    bodies = [checks.salted(registry, who, body) for body in bodies]
    with tracing.span("accept.tokenize"):
        try:
            prepared, prompt_tokens = await checks.prepare(registry, settings, bodies, who.tenant, refuse=not batch)
        except InvalidRequest as refused:
            if refused.code == "prompt_too_long" and not batch:
                # The tokenization it cost was work: the refusal counts as one of the
                # tenant's requests (over its rate, a 429 instead), so no key tokenizes for free.
                await parts.quotas.admit(who.config, 1)
            raise
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
    held = None
    if submitted.outcome == "started":
        job = Job.started_at_once(new[0], model=model, tenant=who.tenant, band=band, run=submitted.run)
        # Validated once: the run does not do it again.
        if carry_here:
            held = parts.starts.hold(job, prepared[0])
        else:
            parts.starts.adopt(job, prepared[0])
    else:
        parts.starts.notice(shard, model)
    return Submission(
        ids,
        existing=False,
        started_here=submitted.outcome == "started",
        prompt_tokens=list(prompt_tokens),
        carry=held,
    )


async def replayed(jobs: JobStore, tenant: str, keys: list[str], hashes: list[str]) -> Submission | None:
    """The earlier submission with these Idempotency-Keys, answered before anything is charged."""
    found = [await jobs.idempotent(tenant, key) for key in keys]
    if all(f is None for f in found):
        return None
    if any(f is None for f in found):
        raise Conflict("idempotency_key_reused", "these Idempotency-Keys were used with other requests")
    return checks.replay([f for f in found if f is not None], hashes)


# -- 2. start -----------------------------------------------------------------------------


async def start(
    jobs: JobStore, process: StartsRuns, shard: Shard, model: str, *, most: int, light_only: bool
) -> list[Job] | str:
    """TAKE: start the fair queue's next requests of `model` in the shard for this process,
    up to `most` in one call (dispatch/scheduler.py tells the policy; the dispatcher, when
    to ask and for how many), each with its new run's token; the process holds each at
    once (its task, its slot, its lease: `adopt`), whose task carries it through stages 3
    to 5 (`carry`). The Jobs started, or "empty", or "held" (only tenants outside the
    headroom wait)."""
    started = await jobs.take_many(shard, model, process.consumer, most=most, light_only=light_only)
    if isinstance(started, list):
        for job in started:
            process.adopt(job)
    return started


# -- 3 to 5: a request started in this process --------------------------------------------


class RunsRequests(Protocol):
    """The replica call of a run (dispatch/runner.py): route, call, relay."""

    async def run(self, job: Job, control: Any, prepared: Any = None) -> ResultRecord: ...
    def partial(self, job: Job, control: Any, status: State, error: ErrorInfo | None) -> ResultRecord: ...


class Delivers(Protocol):
    """This process's waiters for ended requests (results/notifier.py)."""

    def running(self, request_id: str) -> AbstractContextManager[None]: ...
    def deliver(self, request_id: str, record: str) -> None: ...


@dataclass
class Carrier:
    """Stages 3 to 5 with this process's parts: what the dispatcher's task of each request
    it holds calls (`carry`). Every record this process ends, by whichever stage (a run's
    FINISH, a cancel while queued, an expiry), goes through `ended` (JobStore.on_ended)."""

    jobs: JobStore
    runner: RunsRequests
    registry: ModelRegistry
    notifier: Delivers
    metrics: GatewayMetrics
    max_deliveries: int
    # Called with every record this process ends (quick, in-line: they spawn what must wait).
    finished_hooks: list[Callable[[ResultRecord], None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.jobs.on_ended.append(functools.partial(ended, self))


async def carry(
    parts: Carrier, job: Job, control: Any, prepared: Any, *, on_acquired: Callable[[], None]
) -> str | None:
    """A started request's life in this process, in the task that holds it (the call's
    that submitted it, for a `Prefer: wait` POST /infer started here; else the
    dispatcher's): run it (3), finish it (4), deliver its record (5); the record's JSON,
    or None when this run did not finish it. A run found stale (another run took the
    request over) stops without finishing: the newer run finishes it. A run that breaks
    otherwise finishes nothing: its lease runs out, and RECLAIM puts it first in line to
    run again (a replica's failure is not that: the runner tries another replica within
    the run)."""
    request_id = job.request_id
    # This task's log context is a copy of its spawner's (maybe another request's run).
    bind_request_ids(trace_id=job.payload.get("trace_id"), request_id=request_id)
    # Its `done` message is for other processes: this one is handed the record (deliver).
    with parts.notifier.running(request_id):
        try:
            parts.metrics.count_queue_wait(job.model, max(0.0, time.time() - job.created_at))
            record = await run(
                parts.runner, job, control, prepared, max_deliveries=parts.max_deliveries, on_acquired=on_acquired
            )
            data = await finish(parts.jobs, job, record, control.emitter, output_event=output_event(parts, job, record))
            if data is not None:
                deliver(parts, record, data)
            return data
        except StaleRun:
            log.warning(
                "request %s: attempt %d found itself stale; the newer run finishes it", request_id, job.attempts
            )
        except Exception:
            log.exception("request %s: unexpected error; it is run again when its lease runs out", request_id)
        return None


# -- 3. run -------------------------------------------------------------------------------


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


async def emit(jobs: JobStore, shard: Shard, events: list[TokenEvent], writers: list[asyncio.Future[Emitted]]) -> None:
    """EMIT: the token events of several runs of one shard, as the relay gathered them
    (dispatch/relay.py), in one call, fenced by each run's token. Each writer learns its
    own event's outcome (written; a gap in the stream to send again; the run stale; a
    cancel asked: dispatch/emitter.py acts on it), or the call's error (the emitter keeps
    its pieces and tries again)."""
    try:
        replies = await jobs.emit_many(shard, events)
    except BaseException as exc:
        for writer in writers:
            if not writer.done():
                writer.set_exception(exc if isinstance(exc, Exception) else ConnectionError("relay stopped"))
        if not isinstance(exc, Exception):
            raise
    else:
        for writer, reply in zip(writers, replies, strict=True):
            if not writer.done():
                writer.set_result(reply)


def keep_leases(client: Any, shard: Shard, consumer: str, lease_ms: int, runs: list[tuple[str, str]]) -> list[int]:
    """RENEW, from the lease keeper's thread (dispatch/leases.py) on its own synchronous
    connection: per (request id, run token) 1 still ours, 2 ours but asked to cancel, 0
    stale, 3 ended (its own FINISH landed first: scripts.RENEW). A node that does not know
    the script (a promoted replica) is given it."""
    renew = client.register_script(scripts.RENEW)
    keys, args = scripts.renew_call(shard, consumer, lease_ms, runs)
    try:
        flags = renew(keys=keys, args=args)
    except NoScriptError:
        client.script_load(scripts.RENEW)
        flags = renew(keys=keys, args=args)
    return [int(flag) for flag in flags]


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


def output_event(parts: Carrier, job: Job, record: ResultRecord) -> bool:
    """Whether FINISH sends the whole output as one `output` event (it did not go out as tokens)."""
    adapter = parts.registry.adapters.get(job.model)
    streamed = adapter is not None and adapter.decoupled and job.payload.get("stream")
    return bool(record.status == State.SUCCEEDED and not streamed and record.outputs)


# -- 5. deliver ---------------------------------------------------------------------------


def deliver(parts: Carrier, record: ResultRecord, data: str) -> None:
    """The record of a run this process finished, to this process's waiters at once
    (long polls, SSE, /v1 calls; other processes' wake on FINISH's `done` message and read
    it; the binders store it from the results stream)."""
    parts.notifier.deliver(record.request_id, data)
    # DEBUG: a request's INFO line is the edge's access line (issue 61: one a request).
    log.debug(
        "request %s: %s on %s, %.0f ms after submission",
        record.request_id,
        record.status.value,
        record.replica or "no replica",
        record.timings.total_ms or 0,
    )


def ended(parts: Carrier, record: ResultRecord) -> None:
    """Every record this process ends, whichever stage ended it: its hooks (usage, the
    tenant's counters, the token quota) and metrics, once per request (JobStore.on_ended)."""
    for hook in parts.finished_hooks:
        try:
            hook(record)
        except Exception as exc:  # accounting must not break finishing
            log.warning("after %s finished: %s: %s", record.request_id, type(exc).__name__, exc)
    parts.metrics.count_finished(record)


# -- the other ends -----------------------------------------------------------------------


async def cancel(jobs: JobStore, request_id: str) -> State | None:
    """CANCEL: a queued request ends now (FINISH from queued); a running one is asked to
    stop (its dispatcher sees the flag, by pub/sub at once or by its lease keeper). The
    state after the call, None if unknown."""
    state = await jobs.cancel(request_id)
    if state == "missing":
        return None
    if state != State.QUEUED.value:
        return State(state)
    job = await jobs.load(request_id)
    canceled = job.record(State.CANCELED) if job is not None and job.state == State.QUEUED else None
    if canceled is not None and isinstance(await jobs.finish(canceled, allowed=(State.QUEUED,)), str):
        return State.CANCELED
    job = await jobs.load(request_id)  # it started meanwhile: its dispatcher sees the flag
    return job.state if job else None


async def hand_over(jobs: JobStore, consumer: str, runs: list[tuple[str, str]]) -> None:
    """HANDOVER: the runs a draining process still holds, (request id, run token), go
    first in line for any other process at once (a hand-over does not count against the
    delivery limit). If that fails, their leases run out and RECLAIM does it, later."""
    try:
        moved = await jobs.handover(consumer, runs)
    except Exception as exc:
        log.warning("handing %d requests on failed (%s); they are reclaimed when their leases end", len(runs), exc)
        return
    log.info("handed %d running requests on to other gateways", moved)


async def sweep(jobs: JobStore, shard: Shard, *, grace_s: float, most: int = SWEEP_MOST) -> None:
    """The ends no run reaches, in one shard (every gateway's sweeper; any may, all at
    once is harmless). RECLAIM: runs whose lease ran out (their process died) go first in
    line. Then the requests whose deadline passed expire: those due (at most `most`) read
    in one round trip, those that ended meanwhile dropped from the deadlines set in one
    command, the rest expired together (their FINISHes share the group commit's calls). A
    running one is given grace_s past its deadline: its own dispatcher cuts it first. A
    Redis away leaves the shard to the next sweep; one broken request, the others to this one."""
    try:
        reclaimed = await jobs.reclaim(shard)
    except REDIS_OUTAGE as exc:
        log.warning("reclaiming in %s failed: %s", shard.prefix, type(exc).__name__)
    else:
        if reclaimed:
            log.info("%d running requests of %s lost their dispatcher; they start again", reclaimed, shard.prefix)
    now = time.time()
    try:
        due = await jobs.overdue(shard, now, most)
        if not due:
            return
        found = await jobs.load_many(due)
    except REDIS_OUTAGE as exc:
        log.warning("expiring in %s failed: %s", shard.prefix, type(exc).__name__)
        return
    for request_id, job in zip(due, found, strict=True):
        if isinstance(job, Exception):
            log.warning("expiring %s failed: %s", request_id, job)
    loaded = [(rid, job) for rid, job in zip(due, found, strict=True) if not isinstance(job, Exception)]
    gone = [rid for rid, job in loaded if job is None or job.state.terminal]
    overdue = [
        job
        for _, job in loaded
        if job is not None
        and (job.state == State.QUEUED or (job.state == State.RUNNING and now > job.deadline + grace_s))
    ]
    outcomes = await asyncio.gather(
        *(expire(jobs, job) for job in overdue),
        jobs.forget_deadlines(shard, gone),
        return_exceptions=True,
    )
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            log.warning("expiring in %s failed: %s", shard.prefix, outcome)


async def expire(jobs: JobStore, job: Job) -> bool:
    """End a request whose deadline passed before it ended (FINISH from the state it was
    read in); False when it ended meanwhile."""
    error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed before it ended")
    return await jobs.finish(job.record(State.EXPIRED, error=error), allowed=(job.state,)) is not None
