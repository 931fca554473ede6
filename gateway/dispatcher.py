"""The dispatcher: asyncio tasks in every gateway process that take accepted requests
from the request lanes (one consumer group for all gateways), run them on the best
Triton replica, stream their events, and finish them.

- Reads only as many requests as the replicas have free slots, so the rest stay in the
  stream for other gateway processes.
- Keeps its pending entries fresh (XCLAIM to itself); entries left idle by a dead
  process are reclaimed with XAUTOCLAIM and run again, unless their first run finished.
- A failure before the first response is retried once on another replica.
- Cancel: a queued request never runs; a running one has its gRPC stream cancelled and,
  for models behind an ensemble, a stop request sent (see llm_generator).
- Deadlines: the remaining time is the gRPC timeout and Triton's request timeout; a
  sweeper expires requests whose deadline passed while they waited."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from redis.asyncio import Redis
from tritonclient.utils import InferenceServerException

from gateway.adapters import ADAPTERS, ModelAdapter, tensor
from gateway.contracts import (
    CANCEL_CHANNEL,
    DEADLINES_KEY,
    DISPATCH_GROUP,
    REQUEST_LANES,
    ErrorInfo,
    EventKind,
    ResultRecord,
    State,
)
from gateway.jobs import Job, JobStore
from gateway.metrics import GatewayMetrics
from gateway.notifier import CompletionNotifier
from gateway.replicas import Replica, ReplicaPool
from gateway.settings import GatewaySettings
from gateway.streams import trim_acknowledged

log = logging.getLogger(__name__)


class InferenceFailed(Exception):
    def __init__(self, code: str, message: str, *, retryable: bool, eject: bool = False) -> None:
        super().__init__(message)
        self.code, self.message, self.retryable, self.eject = code, message, retryable, eject


def classify(exc: Exception) -> InferenceFailed:
    """Sort Triton/gRPC errors: bad input (fail now), an unreachable replica (eject it,
    retry elsewhere), or a model error (retry once elsewhere)."""
    if isinstance(exc, InferenceFailed):
        return exc
    if isinstance(exc, InferenceServerException):
        status, message = str(exc.status() or ""), exc.message() or str(exc)
    elif isinstance(exc, grpc.aio.AioRpcError):
        status, message = str(exc.code()), exc.details() or str(exc)
    else:
        status, message = "", str(exc)
    # Errors inside a gRPC stream carry only a message; our models start bad-input ones so.
    if "INVALID_ARGUMENT" in status or message.lower().startswith("invalid"):
        return InferenceFailed("invalid_input", message, retryable=False)
    if "UNAVAILABLE" in status or isinstance(exc, OSError):
        return InferenceFailed("replica_unavailable", message, retryable=True, eject=True)
    return InferenceFailed("inference_failed", message, retryable=True)


@dataclass
class Progress:
    parts: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_response_s: float | None = None
    replica: str | None = None
    # Ends the Triton stream in flight at once. Cancelling the asyncio task is not
    # enough: a task waiting on a gRPC stream read only sees it when the stream ends.
    abort: Callable[[], None] | None = None

    def add(self, part: dict[str, Any]) -> None:
        if self.first_response_s is None:
            self.first_response_s = time.monotonic() - self.started
        self.parts.append(part)

    def stop_triton(self) -> None:
        abort, self.abort = self.abort, None
        if abort:
            abort()


@dataclass
class Running:
    lane: str
    entry_id: str
    task: asyncio.Task[None] | None = None
    execution: asyncio.Task[ResultRecord] | None = None
    progress: Progress = field(default_factory=Progress)
    cancel_requested: bool = False

    def stop(self) -> None:
        self.progress.stop_triton()
        if self.execution:
            self.execution.cancel()


class Dispatcher:
    def __init__(
        self,
        redis: Redis,
        jobs: JobStore,
        pool: ReplicaPool,
        settings: GatewaySettings,
        metrics: GatewayMetrics,
        notifier: CompletionNotifier,
        adapters: dict[str, ModelAdapter] = ADAPTERS,
    ) -> None:
        self.redis = redis
        self.notifier = notifier
        self.jobs = jobs
        self.pool = pool
        self.settings = settings
        self.metrics = metrics
        self.adapters = adapters
        self.consumer = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
        self.running: dict[str, Running] = {}
        self._wake = asyncio.Event()
        self._loops: list[asyncio.Task[None]] = []
        self._side_tasks: set[asyncio.Task[None]] = set()
        self._accepting = True

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        await self.jobs.ensure_groups()
        for loop in (self._read_loop, self._reclaim_loop, self._heartbeat_loop, self._sweep_loop, self._cancel_loop):
            self._loops.append(asyncio.create_task(loop(), name=f"dispatcher{loop.__name__}"))

    async def stop(self, drain_s: float = 10.0) -> None:
        """Stop taking work; let running requests finish for up to drain_s. What is left
        stays pending in Redis and another gateway process runs it."""
        self._accepting = False
        for task in self._loops:
            task.cancel()
        await asyncio.gather(*self._loops, return_exceptions=True)
        tasks = [r.task for r in self.running.values() if r.task]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # -- taking work -----------------------------------------------------------------

    def _free(self) -> int:
        waiting = sum(1 for r in self.running.values() if r.execution is None)
        return min(self.pool.free_slots() - waiting, self.settings.dispatch_batch)

    async def _read_loop(self) -> None:
        streams = {lane: ">" for lane in REQUEST_LANES}
        while self._accepting:
            free = self._free()
            if free <= 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.5)
                except TimeoutError:
                    pass
                continue
            try:
                response = await self.redis.xreadgroup(DISPATCH_GROUP, self.consumer, streams, count=free, block=1000)
            except Exception as exc:  # Redis restarting: keep trying
                log.warning("reading requests failed: %s", exc)
                await asyncio.sleep(0.5)
                continue
            for lane, entries in sorted(response or [], key=lambda item: REQUEST_LANES.index(item[0])):
                for entry_id, fields in entries:
                    self._spawn(lane, entry_id, fields)

    def _spawn(self, lane: str, entry_id: str, fields: dict[str, str]) -> None:
        request_id = fields.get("id", "")
        if not request_id or request_id in self.running:
            return
        running = Running(lane=lane, entry_id=entry_id)
        self.running[request_id] = running
        running.task = asyncio.create_task(self._handle(request_id, running), name=f"request-{request_id}")

    async def _reclaim_loop(self) -> None:
        """Take over requests whose dispatcher stopped heartbeating (it died)."""
        interval = self.settings.claim_idle_ms / 2000
        while self._accepting:
            await asyncio.sleep(interval)
            for lane in REQUEST_LANES:
                free = self._free()
                if free <= 0:
                    break
                try:
                    reply = await self.redis.xautoclaim(
                        lane, DISPATCH_GROUP, self.consumer, self.settings.claim_idle_ms, "0-0", count=free
                    )
                except Exception as exc:
                    log.warning("reclaim on %s failed: %s", lane, exc)
                    continue
                for entry_id, fields in reply[1]:
                    if fields:
                        log.info("reclaimed %s from a dead dispatcher", entry_id)
                        self._spawn(lane, entry_id, fields)
                    else:  # trimmed away: nothing to run
                        await self.redis.xack(lane, DISPATCH_GROUP, entry_id)

    async def _heartbeat_loop(self) -> None:
        """Reset the idle time of our pending entries so no one reclaims live work."""
        interval = self.settings.claim_idle_ms / 3000
        while True:
            await asyncio.sleep(interval)
            by_lane: dict[str, list[str]] = {}
            for running in self.running.values():
                by_lane.setdefault(running.lane, []).append(running.entry_id)
            for lane, ids in by_lane.items():
                try:
                    await self.redis.xclaim(lane, DISPATCH_GROUP, self.consumer, 0, ids, justid=True)
                except Exception as exc:
                    log.warning("heartbeat on %s failed: %s", lane, exc)

    async def _cancel_loop(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(CANCEL_CHANNEL)
        try:
            async for message in pubsub.listen():
                if message.get("type") != "message":
                    continue
                running = self.running.get(message["data"])
                if running:
                    running.cancel_requested = True
                    running.stop()
        finally:
            await pubsub.aclose()

    async def _sweep_loop(self) -> None:
        """Expire requests whose deadline passed while nobody ran them (no replica, or
        their dispatcher died); trim acknowledged request entries."""
        last_trim = 0.0
        while True:
            await asyncio.sleep(self.settings.sweep_interval_s)
            try:
                await self._expire_overdue()
                self.metrics.backlog.set(await self.jobs.backlog())
                for replica in self.pool.replicas:
                    self.metrics.replica_healthy.labels(replica.url).set(1 if replica.healthy else 0)
                if time.monotonic() - last_trim > 30:
                    last_trim = time.monotonic()
                    await self._trim_lanes()
            except Exception as exc:
                log.warning("sweep failed: %s", exc)

    async def _expire_overdue(self) -> None:
        now = time.time()
        # Running requests get a grace period: their own dispatcher expires them first.
        grace = self.settings.claim_idle_ms / 1000
        for request_id in await self.redis.zrangebyscore(DEADLINES_KEY, "-inf", now, start=0, num=200):
            job = await self.jobs.load(request_id)
            if job is None:
                await self.redis.zrem(DEADLINES_KEY, request_id)
            elif job.state == State.QUEUED or (job.state == State.RUNNING and now > job.deadline + grace):
                error = ErrorInfo(code="deadline_exceeded", message="the request's deadline passed before it ended")
                record = job.record(State.EXPIRED, error=error)
                if await self.jobs.finish(record, allowed=(job.state,)) is not None:
                    self._count(record)

    async def _trim_lanes(self) -> None:
        for lane in REQUEST_LANES:
            await trim_acknowledged(self.redis, lane, DISPATCH_GROUP)

    # -- running one request -----------------------------------------------------------

    async def _handle(self, request_id: str, running: Running) -> None:
        try:
            job = await self.jobs.start(request_id, self.consumer)
            if job is None:  # unknown, or finished already (by cancel, expiry or a first run)
                await self.redis.xack(running.lane, DISPATCH_GROUP, running.entry_id)
                return
            self.metrics.queue_wait.labels(job.model).observe(max(0.0, time.time() - job.created_at))
            record = await self._run(job, running)
            data = await self.jobs.finish(record, output_event=self._output_event(job, record))
            if data is not None:
                self.notifier.deliver(request_id, data)
                self._count(record)
        except asyncio.CancelledError:
            raise  # shutting down: the entry stays pending for another dispatcher
        except Exception:
            log.exception("request %s: unexpected error", request_id)
        finally:
            self.running.pop(request_id, None)
            self._wake.set()

    async def _run(self, job: Job, running: Running) -> ResultRecord:
        if job.cancel_requested or running.cancel_requested:
            return job.record(State.CANCELED)
        if job.attempts > self.settings.max_deliveries:
            return job.record(
                State.FAILED,
                error=ErrorInfo(code="too_many_attempts", message=f"started {job.attempts - 1} times without finishing"),
            )
        progress = running.progress
        running.execution = asyncio.create_task(self._execute(job, progress))
        try:
            done, _ = await asyncio.wait({running.execution}, timeout=max(0.0, job.deadline - time.time()))
        except asyncio.CancelledError:  # shutting down: stop Triton, leave the entry pending
            running.stop()
            raise
        if not done:
            running.stop()
            await asyncio.gather(running.execution, return_exceptions=True)
            return self._partial(job, progress, State.EXPIRED, ErrorInfo(
                code="deadline_exceeded", message="the request's deadline passed while it ran"))
        try:
            return running.execution.result()
        except asyncio.CancelledError:
            if running.cancel_requested:
                return self._partial(job, progress, State.CANCELED, None)
            raise

    def _output_event(self, job: Job, record: ResultRecord) -> dict[str, Any] | None:
        """The whole output as one `output` event, unless it already went out as tokens."""
        adapter = self.adapters.get(job.model)
        streamed = adapter is not None and adapter.decoupled and job.payload.get("stream")
        return record.outputs if record.status == State.SUCCEEDED and not streamed else None

    def _partial(self, job: Job, progress: Progress, status: State, error: ErrorInfo | None) -> ResultRecord:
        adapter = self.adapters[job.model]
        outputs = adapter.merge(progress.parts) if progress.parts else None
        return job.record(status, outputs=outputs, error=error, replica=progress.replica, ttft_s=progress.first_response_s)

    async def _execute(self, job: Job, progress: Progress) -> ResultRecord:
        adapter = self.adapters.get(job.model)
        if adapter is None:
            return job.record(State.FAILED, error=ErrorInfo(code="unknown_model", message=f"no model {job.model!r}"))
        inputs, parameters = adapter.validate(job.payload["inputs"], job.payload.get("parameters", {}))
        stream = bool(job.payload.get("stream", False))
        tried: frozenset[str] = frozenset()
        while True:
            try:
                replica = await self.pool.acquire(job.model, job.deadline - time.time(), exclude=tried)
            except TimeoutError:
                return job.record(State.EXPIRED, error=ErrorInfo(
                    code="no_replica", message=f"no Triton replica served {job.model!r} before the deadline"))
            self.metrics.inflight.labels(replica.url).set(replica.inflight)
            progress.replica = replica.url
            try:
                await self._call(replica, adapter, job, inputs, parameters, stream, progress)
                return job.record(
                    State.SUCCEEDED, outputs=adapter.merge(progress.parts), replica=replica.url,
                    ttft_s=progress.first_response_s,
                )
            except Exception as exc:
                failure = classify(exc)
                if failure.eject:
                    self.pool.eject(replica, failure.message)
                tried = tried | {replica.url}
                # Retry once elsewhere, and only before the first response reached anyone.
                if not failure.retryable or progress.parts or len(tried) > 1:
                    return job.record(State.FAILED, error=ErrorInfo(code=failure.code, message=failure.message),
                                      replica=replica.url)
                log.warning("request %s failed on %s (%s); retrying elsewhere", job.request_id, replica.url, failure.message)
            finally:
                await self.pool.release(replica)
                self.metrics.inflight.labels(replica.url).set(replica.inflight)

    async def _call(
        self, replica: Replica, adapter: ModelAdapter, job: Job, inputs: Any, parameters: Any, stream: bool,
        progress: Progress,
    ) -> None:
        remaining = max(0.001, job.deadline - time.time())
        triton_inputs = adapter.triton_inputs(inputs, parameters, stream)
        if not adapter.decoupled:
            result = await replica.client.infer(
                job.model, triton_inputs, outputs=adapter.requested_outputs(), request_id=job.request_id,
                client_timeout=remaining, timeout=int(remaining * 1e6),
            )
            progress.add(adapter.parse(result))
            return
        request = {
            "model_name": job.model, "inputs": triton_inputs, "outputs": adapter.requested_outputs(),
            "request_id": job.request_id, "timeout": int(remaining * 1e6),
        }
        responses = replica.client.stream_infer(_once(request), stream_timeout=remaining)

        def abort() -> None:
            responses.cancel()
            if adapter.stop_model:
                self._background(self._stop(replica, adapter.stop_model, job.request_id))

        progress.abort = abort
        try:
            async for result, error in responses:
                if error is not None:
                    raise classify(error)
                part = adapter.parse(result)
                progress.add(part)
                if stream:
                    await self.jobs.publish(job.request_id, EventKind.TOKEN, {"index": len(progress.parts) - 1, **part})
        except asyncio.CancelledError:
            progress.stop_triton()
            raise
        finally:
            progress.abort = None

    def _background(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._side_tasks.add(task)  # keep a reference until it is done
        task.add_done_callback(self._side_tasks.discard)

    async def _stop(self, replica: Replica, model: str, request_id: str) -> None:
        """Tell the generator to end request_id (the ensemble does not pass cancellation on)."""
        request = {"model_name": model, "inputs": [tensor("stop", np.array([[True]]), "BOOL")], "request_id": request_id}
        try:
            async with asyncio.timeout(5):
                async for _ in replica.client.stream_infer(_once(request)):
                    pass
        except Exception as exc:
            log.warning("stop for %s on %s failed: %s", request_id, replica.url, exc)

    def _count(self, record: ResultRecord) -> None:
        self.metrics.finished.labels(record.model, record.status.value).inc()
        if record.timings.total_ms is not None:
            self.metrics.latency.labels(record.model).observe(record.timings.total_ms / 1000)
        if record.timings.ttft_ms is not None:
            self.metrics.ttft.labels(record.model).observe(record.timings.ttft_ms / 1000)


async def _once(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield request
