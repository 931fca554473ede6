"""The dispatcher: asyncio tasks in every gateway process that take accepted requests
from the queues (one consumer group for all gateways), run them, and finish them.

- Reads a model's queues only while replicas have room for it, a bounded number ahead.
- Starts requests reclaimed from dead dispatchers first, then by band and tenant
  (scheduler.py).
- Every run holds its attempt number from START; a heartbeat checks it (and the cancel
  flag) and keeps its queue entry claimed. A run that finds itself stale stops without
  finishing; a cancel is a flag in Redis, pub/sub only makes it fast.
- Deadlines: a run is stopped and ends `expired` when its deadline passes.
- On shutdown: running requests get drain_s to finish; the rest are handed over (their
  entries made idle at once) for another gateway to take."""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from gateway.common.logs import bind_request_ids
from gateway.common.retry import LoopHealth, supervise
from gateway.common.streams import Entry, StreamConsumer
from gateway.protocol import ErrorInfo, ResultRecord, State
from gateway.protocol.redis_keys import BANDS, CANCEL_CHANNEL, parse_queue_stream
from gateway.server.dispatch.emitter import StaleRun
from gateway.server.dispatch.runner import RunControl, Runner
from gateway.server.dispatch.scheduler import LocalQueue, QueueRegistry
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.config import TenantConfig, TenantStore

log = logging.getLogger(__name__)

READ_BLOCK_MS = 200
# A tenant counts as active (and is kept a free slot) this long after its last request.
FAIR_WINDOW_S = 5.0


@dataclass
class Running:
    entry: Entry
    model: str
    control: RunControl | None = None
    task: asyncio.Task[None] | None = None
    acquired: bool = False


@dataclass
class Dispatcher:
    redis: Redis
    blocking: Redis  # for blocking reads (a longer socket timeout)
    consumer: StreamConsumer
    jobs: JobStore
    pool: ReplicaPool
    registry: ModelRegistry
    runner: Runner
    settings: GatewaySettings
    metrics: GatewayMetrics
    notifier: CompletionNotifier
    # Tenants' weights (fair scheduling) and concurrency limits; defaults without it.
    tenants: TenantStore | None = None
    # Called (in the background) with every record this process finishes.
    finished_hooks: list[Callable[[ResultRecord], Awaitable[None]]] = field(default_factory=list)
    running: dict[str, Running] = field(default_factory=dict)
    health: dict[str, LoopHealth] = field(default_factory=dict)
    _loops: list[asyncio.Task[None]] = field(default_factory=list)
    _accepting: bool = True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.local = LocalQueue(self._share)
        # Requests running per tenant, all gateways (refreshed by the read loop) plus
        # what this process started since.
        self._tenant_running: dict[str, int] = {}
        self._seen: dict[str, float] = {}  # tenant -> when this process last saw its work
        self._side: set[asyncio.Task[None]] = set()
        self.queues = QueueRegistry(self.redis, window_s=self.settings.max_timeout_s + 120)

    async def start(self) -> None:
        for name, loop in (
            ("dispatcher read", self._read_loop),
            ("dispatcher reclaim", self._reclaim_loop),
            ("dispatcher heartbeat", self._heartbeat_loop),
            ("dispatcher cancel channel", self._cancel_loop),
        ):
            health = self.health[name] = LoopHealth(name)
            self._loops.append(asyncio.create_task(supervise(health, loop), name=name))

    async def stop(self, drain_s: float | None = None) -> None:
        """Stop taking work; let running requests finish for up to drain_s; hand the rest
        over to other gateways at once (their entries are made idle)."""
        self._accepting = False
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        drain = self.settings.drain_s if drain_s is None else drain_s
        tasks = [r.task for r in self.running.values() if r.task]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        left = [r.entry for r in self.running.values()] + self.local.drain()
        if left:
            await self._hand_over(left)

    async def _hand_over(self, entries: list[Entry]) -> None:
        by_stream: dict[str, list[str]] = {}
        for entry in entries:
            by_stream.setdefault(entry.stream, []).append(entry.id)
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for stream, ids in by_stream.items():
                    pipe.xclaim(
                        stream,
                        self.consumer.group,
                        self.consumer.consumer,
                        0,
                        ids,
                        idle=self.settings.claim_idle_ms,
                        justid=True,
                    )
                await pipe.execute()
            log.info("handed %d requests over to other gateways", len(entries))
        except Exception as exc:
            log.warning("handing %d requests over failed (%s); they are reclaimed when idle", len(entries), exc)

    # -- taking work -------------------------------------------------------------------

    def can_start_now(self, model: str, tenant: str) -> str:
        """This process's consumer name if a request of `model` for `tenant` can start here
        at once (a free slot, nothing of the model buffered here, the tenant's share
        allows it), for SUBMIT to start it in the same round trip; else ""."""
        if (
            not self._accepting
            or model not in self.registry
            or self.local.count(model)
            or self._room(model) <= 0
            or not self._may_start(model, tenant)
        ):
            return ""
        return self.consumer.consumer

    def adopt(
        self,
        *,
        request_id: str,
        stream: str,
        entry: str,
        model: str,
        tenant: str,
        payload: dict[str, Any],
        created_at: float,
        deadline: float,
    ) -> None:
        """Run a request SUBMIT started for this process (attempt 1, already running)."""
        now = time.time()
        job = Job(
            request_id=request_id,
            model=model,
            tenant=tenant,
            state=State.RUNNING,
            payload=payload,
            created_at=created_at,
            deadline=deadline,
            started_at=now,
            attempts=1,
            emitted=0,
            cancel_requested=False,
            stored=False,
            stream=stream,
            entry=entry,
        )
        self.queues.add(stream)
        self._seen[tenant] = time.monotonic()
        self._tenant_running[tenant] = self._tenant_running.get(tenant, 0) + 1
        self._spawn(Entry(stream, entry, {"id": request_id}), model, job)

    def notice(self, stream: str) -> None:
        """A request was just queued on `stream` by this process: read it without waiting
        for the next look at the queue registry."""
        self.queues.add(stream)
        self._wake.set()

    def _free(self, model: str) -> int:
        adapter = self.registry.adapters.get(model)
        return self.pool.free_slots(adapter.triton_model) if adapter else 0

    def _room(self, model: str) -> int:
        waiting = sum(1 for r in self.running.values() if r.model == model and not r.acquired)
        return self._free(model) - waiting

    def _config(self, tenant: str) -> TenantConfig | None:
        if self.tenants is None:
            return None
        config = self.tenants.cached(tenant)
        if config is None:  # learn it for next time; until then, the defaults
            self._background(self._learn(tenant))
        return config

    async def _learn(self, tenant: str) -> None:
        if self.tenants is not None:
            await self.tenants.get(tenant)

    def _share(self, tenant: str) -> float:
        """The tenant's running requests (all gateways) per unit of its weight."""
        config = self._config(tenant)
        return self._tenant_running.get(tenant, 0) / (config.weight if config else 1.0)

    def _may_start(self, model: str, tenant: str) -> bool:
        """Below its concurrency limit, and leaving headroom: one free slot for each other
        tenant active lately with nothing waiting here, so a light tenant's next request
        starts at once instead of queueing behind a heavy one. (Work-conserving but for
        that slot: a tenant alone gets everything.)"""
        config = self._config(tenant)
        limit = config.limits.max_concurrent if config else 0
        if limit and self._tenant_running.get(tenant, 0) >= limit:
            return False
        now = time.monotonic()
        idle_others = sum(
            1
            for other, seen in self._seen.items()
            if other != tenant and now - seen < FAIR_WINDOW_S and not self.local.waiting(model, other)
        )
        return self._room(model) > idle_others

    def _saw(self, entry: Entry) -> None:
        self._seen[parse_queue_stream(entry.stream)[2]] = time.monotonic()

    def _background(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._side.add(task)
        task.add_done_callback(self._side.discard)

    def _pump(self) -> None:
        """Start buffered requests while their models have room."""
        if not self._accepting:
            return
        for model in self.local.models():
            allowed = functools.partial(self._may_start, model)
            while self._room(model) > 0 and (entry := self.local.pop(model, allowed)) is not None:
                tenant = parse_queue_stream(entry.stream)[2]
                self._tenant_running[tenant] = self._tenant_running.get(tenant, 0) + 1
                self._spawn(entry, model)

    def _spawn(self, entry: Entry, model: str, job: Job | None = None) -> None:
        request_id = entry.fields.get("id", "")
        if not request_id or request_id in self.running:
            return
        running = Running(entry=entry, model=model)
        self.running[request_id] = running
        running.task = asyncio.create_task(self._handle(request_id, running, job), name=f"request-{request_id}")

    async def _read_loop(self) -> None:
        while self._accepting:
            await self.queues.refresh()
            self._tenant_running = await self.jobs.running()
            self._pump()
            plan = self._read_plan()
            if not plan:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=READ_BLOCK_MS / 1000)
                except TimeoutError:
                    pass
                continue
            got = await self._read(plan)
            if not got:
                # Nothing new: wait on every queue with room, so a new entry wakes us.
                everything = {s: 1 for bands in plan.values() for counts in bands.values() for s in counts}
                got = await self.consumer.read(everything, block_ms=READ_BLOCK_MS, reader=self.blocking)
                for entry in got:
                    self.local.push(entry)
                    self._saw(entry)
            self._pump()

    def _read_plan(self) -> dict[str, dict[str, dict[str, int]]]:
        """model -> band -> {stream: count}: what to read, for models with room. The
        buffer is filled up to `dispatch_buffer` ahead, and beyond that every tenant with
        nothing buffered still gets one entry read, so a light tenant's request is here
        to start the moment a slot frees, however much a heavy one has buffered."""
        plan: dict[str, dict[str, dict[str, int]]] = {}
        for model in self.queues.streams:
            if model not in self.registry or self._free(model) <= 0:
                continue
            need = self._room(model) + self.settings.dispatch_buffer - self.local.count(model)
            bands = {}
            for band in BANDS:
                streams = self.queues.of(model, band)
                per = max(1, math.ceil(need / len(streams))) if streams and need > 0 else 0
                counts = {s: per or (0 if self.local.waiting(model, parse_queue_stream(s)[2]) else 1) for s in streams}
                counts = {s: c for s, c in counts.items() if c}
                if counts:
                    bands[band] = counts
            if bands:
                plan[model] = bands
        return plan

    async def _read(self, plan: dict[str, dict[str, dict[str, int]]]) -> list[Entry]:
        """Read band by band (higher first)."""
        got: list[Entry] = []
        for bands in plan.values():
            for band in BANDS:
                if band not in bands:
                    continue
                entries = await self.consumer.read(bands[band], block_ms=None)
                for entry in entries:
                    self.local.push(entry)
                    self._saw(entry)
                got.extend(entries)
        return got

    async def _reclaim_loop(self) -> None:
        """Take over requests whose dispatcher stopped heartbeating (it died), whatever
        our free slots: they start before new work, so they do not expire behind it."""
        interval = self.settings.claim_idle_ms / 2000
        limit = max(64, self.settings.dispatch_buffer * 4)
        while self._accepting:
            await asyncio.sleep(interval)
            await self.queues.refresh()
            for stream in self.queues.all():
                room = limit - len(self.local.entries())
                if room <= 0:
                    break
                for entry in await self.consumer.reclaim(stream, room):
                    request_id = entry.fields.get("id", "")
                    if request_id in self.running:
                        continue  # ours already (a heartbeat was late)
                    log.info("reclaimed %s (%s) from a dead dispatcher", request_id, entry.stream)
                    self.local.push(entry, reclaimed=True)
            self._pump()

    async def _heartbeat_loop(self) -> None:
        """Check every run's fence and cancel flag; keep our entries claimed."""
        interval = self.settings.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(interval)
            await self.check_runs()
            held: dict[str, list[str]] = {}
            for entry in [r.entry for r in self.running.values()] + self.local.entries():
                held.setdefault(entry.stream, []).append(entry.id)
            if held:
                await self.consumer.heartbeat(held)

    async def check_runs(self) -> None:
        runs = [(rid, r) for rid, r in self.running.items() if r.control is not None]
        flags = await self.jobs.check([(rid, r.control.attempt) for rid, r in runs if r.control])
        for (request_id, running), flag in zip(runs, flags, strict=True):
            control = running.control
            if control is None:
                continue
            if flag == 0:
                log.warning(
                    "request %s: attempt %d is stale (another run took over); stopping", request_id, control.attempt
                )
                control.stale = True
                control.stop()
                if running.task:
                    running.task.cancel()
            elif flag == 2 and not control.cancel_requested:
                control.cancel_requested = True
                control.stop()

    async def _cancel_loop(self) -> None:
        pubsub = self.redis.pubsub()
        try:
            await pubsub.subscribe(CANCEL_CHANNEL)
            # Cancels sent while we were not subscribed are flags in Redis: look now.
            await self.check_runs()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=5.0)
                if message is None:
                    await pubsub.ping()
                    continue
                running = self.running.get(message["data"])
                if running and running.control and not running.control.cancel_requested:
                    running.control.cancel_requested = True
                    running.control.stop()
        finally:
            await pubsub.aclose()

    # -- running one request -----------------------------------------------------------

    async def _handle(self, request_id: str, running: Running, started: Job | None = None) -> None:
        entry = running.entry
        # This task's log context is a copy of its spawner's (maybe another request's run).
        bind_request_ids(trace_id=None, request_id=request_id)
        try:
            job = started or await self.jobs.start(request_id, self.consumer.consumer, entry.id)
            if job is None:  # unknown, or ended already (cancel, expiry, or a first run)
                await self.consumer.ack(entry.stream, entry.id)
                return
            bind_request_ids(trace_id=job.payload.get("trace_id"), request_id=request_id)
            control = running.control = RunControl(request_id=request_id, attempt=job.attempts)
            control.cancel_requested = job.cancel_requested
            self.metrics.queue_wait.labels(job.model).observe(max(0.0, time.time() - job.created_at))
            record = await self._run(job, control, running)
            if record is None:
                return
            data = await self.jobs.finish(record, attempt=job.attempts, output_event=self._output_event(job, record))
            if data is not None:
                self.notifier.deliver(request_id, data)
                self.count(record)
                log.info(
                    "request %s: %s on %s, %.0f ms after submission",
                    request_id,
                    record.status.value,
                    record.replica or "no replica",
                    record.timings.total_ms or 0,
                )
        except StaleRun:
            log.warning(
                "request %s: run %s found itself stale; the newer run finishes it", request_id, running.entry.id
            )
        except asyncio.CancelledError:
            if not (running.control and running.control.stale):
                raise  # shutting down: the entry stays pending for another dispatcher
        except Exception:
            log.exception("request %s: unexpected error; it is retried when its entry is reclaimed", request_id)
        finally:
            self.running.pop(request_id, None)
            self._pump()

    async def _run(self, job: Job, control: RunControl, running: Running) -> ResultRecord | None:
        if control.cancel_requested:
            return job.record(State.CANCELED)
        if job.attempts > self.settings.max_deliveries:
            return job.record(
                State.FAILED,
                error=ErrorInfo(
                    code="too_many_attempts", message=f"started {job.attempts - 1} times without finishing"
                ),
            )
        task = asyncio.ensure_future(self._acquire_then_run(job, control, running))
        try:
            async with asyncio.timeout(max(0.0, job.deadline - time.time())):
                return await asyncio.shield(task)
        except TimeoutError:
            control.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return self.runner.partial(
                job,
                control,
                State.EXPIRED,
                ErrorInfo(code="deadline_exceeded", message="the request's deadline passed while it ran"),
            )
        except asyncio.CancelledError:
            control.stop()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise

    async def _acquire_then_run(self, job: Job, control: RunControl, running: Running) -> ResultRecord:
        def acquired() -> None:
            running.acquired = True

        control.on_acquired = acquired
        return await self.runner.run(job, control)

    def _output_event(self, job: Job, record: ResultRecord) -> dict[str, Any] | None:
        """The whole output as one `output` event, unless it already went out as tokens."""
        adapter = self.registry.adapters.get(job.model)
        streamed = adapter is not None and adapter.decoupled and job.payload.get("stream")
        return record.outputs if record.status == State.SUCCEEDED and not streamed else None

    def count(self, record: ResultRecord) -> None:
        for hook in self.finished_hooks:
            self._background(self._run_hook(hook, record))
        self.metrics.finished.labels(record.model, record.status.value).inc()
        if record.timings.total_ms is not None:
            self.metrics.latency.labels(record.model).observe(record.timings.total_ms / 1000)
        if record.timings.ttft_ms is not None:
            self.metrics.ttft.labels(record.model).observe(record.timings.ttft_ms / 1000)

    @staticmethod
    async def _run_hook(hook: Callable[[ResultRecord], Awaitable[None]], record: ResultRecord) -> None:
        try:
            await hook(record)
        except Exception as exc:  # usage accounting must not break finishing
            log.warning("after %s finished: %s: %s", record.request_id, type(exc).__name__, exc)

    def buffered(self) -> int:
        return len(self.local.entries())
