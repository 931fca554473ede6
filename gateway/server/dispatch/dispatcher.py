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
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from gateway.common.retry import LoopHealth, supervise
from gateway.common.streams import Entry, StreamConsumer
from gateway.protocol import ErrorInfo, ResultRecord, State
from gateway.protocol.redis_keys import BANDS, CANCEL_CHANNEL
from gateway.server.dispatch.emitter import StaleRun
from gateway.server.dispatch.runner import RunControl, Runner
from gateway.server.dispatch.scheduler import LocalQueue, QueueRegistry
from gateway.server.metrics import GatewayMetrics
from gateway.server.models import ModelRegistry
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import ReplicaPool
from gateway.server.results.notifier import CompletionNotifier
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)

READ_BLOCK_MS = 200


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
    weight: Any = None  # tenant -> weight (fair scheduling); 1.0 each by default
    running: dict[str, Running] = field(default_factory=dict)
    health: dict[str, LoopHealth] = field(default_factory=dict)
    _loops: list[asyncio.Task[None]] = field(default_factory=list)
    _accepting: bool = True
    _wake: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.local = LocalQueue(self.weight or (lambda tenant: 1.0))
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

    def _pump(self) -> None:
        """Start buffered requests while their models have room."""
        if not self._accepting:
            return
        for model in self.local.models():
            while self._room(model) > 0 and (entry := self.local.pop(model)) is not None:
                self._spawn(entry, model)

    def _spawn(self, entry: Entry, model: str) -> None:
        request_id = entry.fields.get("id", "")
        if not request_id or request_id in self.running:
            return
        running = Running(entry=entry, model=model)
        self.running[request_id] = running
        running.task = asyncio.create_task(self._handle(request_id, running), name=f"request-{request_id}")

    async def _read_loop(self) -> None:
        while self._accepting:
            await self.queues.refresh()
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
            self._pump()

    def _read_plan(self) -> dict[str, dict[str, dict[str, int]]]:
        """model -> band -> {stream: count}: what to read, for models with room."""
        plan: dict[str, dict[str, dict[str, int]]] = {}
        for model in self.queues.streams:
            if model not in self.registry:
                continue
            need = self._room(model) + self.settings.dispatch_buffer - self.local.count(model)
            if need <= 0 or self._free(model) <= 0:
                continue
            bands = {}
            for band in BANDS:
                streams = self.queues.of(model, band)
                if streams:
                    per = max(1, math.ceil(need / len(streams)))
                    bands[band] = {s: per for s in streams}
            if bands:
                plan[model] = bands
        return plan

    async def _read(self, plan: dict[str, dict[str, dict[str, int]]]) -> list[Entry]:
        """Read band by band (higher first) until each model has what it needs."""
        got: list[Entry] = []
        for model, bands in plan.items():
            need = self._room(model) + self.settings.dispatch_buffer - self.local.count(model)
            for band in BANDS:
                if need <= 0 or band not in bands:
                    continue
                entries = await self.consumer.read(bands[band], block_ms=None)
                for entry in entries:
                    self.local.push(entry)
                need -= len(entries)
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

    async def _handle(self, request_id: str, running: Running) -> None:
        entry = running.entry
        try:
            job = await self.jobs.start(request_id, self.consumer.consumer, entry.id)
            if job is None:  # unknown, or ended already (cancel, expiry, or a first run)
                await self.consumer.ack(entry.stream, entry.id)
                return
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
        self.metrics.finished.labels(record.model, record.status.value).inc()
        if record.timings.total_ms is not None:
            self.metrics.latency.labels(record.model).observe(record.timings.total_ms / 1000)
        if record.timings.ttft_ms is not None:
            self.metrics.ttft.labels(record.model).observe(record.timings.ttft_ms / 1000)

    def buffered(self) -> int:
        return len(self.local.entries())
