"""Running one started request on the replicas: choose a replica, send the request,
relay what comes back as token events, and build the record.

A retryable failure of the replica (gone, model not ready there) is tried again on
another replica while one exists, else on the same one once it is back, with backoff and
within the request's deadline; a bad request fails at once with Triton's reason. A
streamed LLM request on the engine path that already sent tokens resumes from them (the
new run continues the sequence); other models retry only before anything was sent.

Only what Triton raises counts against a replica: Redis being away while tokens are
relayed is the emitter's business (it keeps the tokens and retries), never a reason to
eject a healthy replica."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from opentelemetry.trace import SpanKind

from gateway.common import tracing
from gateway.protocol import ErrorInfo, ResultRecord, Route, State, Usage
from gateway.protocol.records import replica_name
from gateway.server.dispatch.emitter import StaleRun, TokenEmitter
from gateway.server.dispatch.failures import Failure, classify
from gateway.server.dispatch.relay import TokenRelay
from gateway.server.models import InvalidInput, ModelAdapter, ModelRegistry, Run
from gateway.server.models.base import Resume, RunError, tensor
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.replicas.batching import BatchedInfer
from gateway.server.routing.router import Router
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)


@dataclass
class RunControl:
    """Shared between a run and whoever may stop it (cancel, shutdown, fencing)."""

    request_id: str
    attempt: int  # for display: the fence is `token`
    token: str = ""  # the run's token: every write of the run is fenced by it
    cancel_requested: bool = False
    stale: bool = False
    first_response_s: float | None = None
    replica: str | None = None
    route: Route | None = None
    started: float = field(default_factory=time.monotonic)
    run: Run | None = None
    # The run's token events (streamed requests): FINISH checks the stream holds them all.
    emitter: TokenEmitter | None = None
    # Ends the Triton call in flight at once.
    abort: Callable[[], None] | None = None
    # Called once the run holds a replica slot (the dispatcher counts waiting runs).
    on_acquired: Callable[[], None] | None = None

    def stop(self) -> None:
        abort, self.abort = self.abort, None
        if abort is not None:
            abort()

    def release(self) -> None:
        """The run has ended: drop the callbacks, which hold their owners (the emitter's
        holds this control), so that a run's objects go when the run does, not when the
        garbage collector finds the cycle."""
        self.on_acquired = self.abort = None
        self.emitter = None


class Runner:
    def __init__(
        self,
        registry: ModelRegistry,
        pool: ReplicaPool,
        jobs: JobStore,
        settings: GatewaySettings,
        background: Callable[[Any], None],
        router: Router | None = None,
    ) -> None:
        self.registry = registry
        self.pool = pool
        self.jobs = jobs
        self.settings = settings
        self.background = background
        # The replica choice (cache-aware for LLMs); least-outstanding without one.
        self.router = router
        # Token events of every stream of this process, one EMIT per shard and window.
        self.relay = TokenRelay(jobs, window_s=settings.token_window_ms / 1000)
        # Embedding requests of one model sharing Triton calls (0: a call each).
        self.batched = BatchedInfer(settings.triton_batch_calls) if settings.triton_batch_calls > 0 else None
        # Without sharing, a many-input request's rows still go in calls of at most the
        # model's max_batch_size (calls of its own, one at a time).
        self.split = self.batched or BatchedInfer(1, shared=False)
        tracing.setup()  # at start, not at the first request (nothing when not configured)

    async def run(self, job: Job, control: RunControl, prepared: Any = None) -> ResultRecord:
        """prepared: the inputs as validated at submission in this process, if they were."""
        try:
            adapter = self.registry.get(job.model)
            if prepared is None:
                inputs, parameters = job.payload["inputs"], job.payload.get("parameters", {})
                # Accepted already (queued by any process): never refused for the tenant's
                # share of the tokenize pool, counted in it all the same; it ends once, as any run.
                prepared = await off_the_loop_if_long(
                    inputs, lambda: adapter.validate(inputs, parameters), tenant=job.tenant, refuse=False
                )
        except InvalidInput as exc:
            return job.record(State.FAILED, error=ErrorInfo(code=exc.code, message=exc.message))
        stream = bool(job.payload.get("stream", False)) and adapter.decoupled
        resume = self._resume(job, adapter, prepared, stream)
        if isinstance(resume, ResultRecord):
            return resume
        if stream:
            control.emitter = self._emitter(job, control)
        failures: list[Failure] = []
        tried: set[str] = set()
        delay = 0.1
        try:
            for attempt in range(self.settings.max_retries + 1):
                try:
                    await self._attempt(job, adapter, prepared, stream, control, tried, failures, resume)
                    break
                except Failure as failure:
                    run = control.run
                    retry = (
                        failure.retryable
                        and attempt < self.settings.max_retries
                        and not control.cancel_requested
                        and (run is None or not run.produced or adapter.resumable)
                    )
                    if not retry:
                        raise
                    log.warning("request %s failed on %s (%s); retrying", job.request_id, control.replica, failure)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.5))
                    delay = min(2.0, delay * 2)
        except StaleRun:
            raise
        except TimeoutError:
            last = failures[-1] if failures else None
            message = "no Triton replica served the request before its deadline"
            if last is not None:
                message += f"; last error: {last.code}: {last.message}"
            return self.partial(job, control, State.EXPIRED, ErrorInfo(code="deadline_exceeded", message=message))
        except asyncio.CancelledError:
            if control.cancel_requested:
                return self.partial(job, control, State.CANCELED, None)
            raise
        except Failure as failure:
            if control.cancel_requested:
                return self.partial(job, control, State.CANCELED, None)
            status = State.EXPIRED if failure.code == "deadline_exceeded" else State.FAILED
            return self.partial(job, control, status, ErrorInfo(code=failure.code, message=failure.message))
        except Exception as exc:  # a defect of ours: the request fails with it, the process goes on
            log.exception("request %s: unexpected error while running", job.request_id)
            error = ErrorInfo(code="internal_error", message=f"{type(exc).__name__}: {exc}"[:500])
            return self.partial(job, control, State.FAILED, error)
        if control.cancel_requested:
            return self.partial(job, control, State.CANCELED, None)
        return self.partial(job, control, State.SUCCEEDED, None)

    def _emitter(self, job: Job, control: RunControl) -> TokenEmitter:
        return TokenEmitter(
            self.relay,
            job.request_id,
            control.token,
            first_index=job.emitted,
            on_cancel=lambda: self._cancel(control),
        )

    def _resume(self, job: Job, adapter: ModelAdapter, prepared: Any, stream: bool) -> Resume | ResultRecord | None:
        """What an earlier run of this request already sent, if any."""
        if not stream or job.emitted == 0:
            return None
        if adapter.resumable:
            return Resume(token_ids=list(job.emitted_ids), pieces=job.emitted)
        if adapter.deterministic(prepared):
            return Resume(pieces=job.emitted)  # the same run again: skip what was sent
        return job.record(
            State.FAILED,
            error=ErrorInfo(
                code="interrupted",
                message=f"the process running this streamed request stopped after {job.emitted} pieces, and this "
                "model cannot resume a sampled stream; submit it again",
            ),
        )

    def partial(self, job: Job, control: RunControl, status: State, error: ErrorInfo | None) -> ResultRecord:
        """The record of the run as far as it got."""
        run = control.run
        outputs, usage = run.final() if run is not None else (None, None)
        if usage is None and job.payload.get("prompt_tokens") is not None:  # counted at submission
            usage = Usage(prompt_tokens=int(job.payload["prompt_tokens"]))
        adapter = self.registry.adapters.get(job.model)
        return job.record(
            status,
            outputs=outputs or None,
            error=error,
            replica=replica_name(control.replica) if control.replica else None,
            route=control.route,
            usage=usage,
            ttft_s=None if adapter is None or adapter.shared_prefix_cache else control.first_response_s,
            index=adapter.index if adapter else None,
        )

    def _cancel(self, control: RunControl) -> None:
        control.cancel_requested = True
        control.stop()

    async def _attempt(
        self,
        job: Job,
        adapter: ModelAdapter,
        prepared: Any,
        stream: bool,
        control: RunControl,
        tried: set[str],
        failures: list[Failure],
        resume: Resume | None,
    ) -> None:
        plan = await self.router.plan(adapter, prepared, job.tenant) if self.router is not None else None
        replica = await self.pool.acquire(
            adapter.triton_model,
            job.deadline - time.time(),
            exclude=frozenset(tried),
            choose=plan.choose if plan else None,
        )
        if control.on_acquired is not None:
            control.on_acquired()
        control.replica = replica.url
        control.route = (plan.route() if plan else None) or Route(
            replica=replica_name(replica.url), policy="least_outstanding", reason="load", load=float(replica.inflight)
        )
        run = adapter.new_run(prepared, resume)
        previous, control.run = control.run, run
        if previous is not None and previous.produced and adapter.resumable:
            run.carry_from(previous)
        try:
            with tracing.span("replica.call", SpanKind.CLIENT):  # Triton gets its traceparent
                tracing.annotate("gateway.replica", replica.url)
                await self._call(replica, run, job, stream, control)
        except Failure as failure:
            failures.append(failure)
            tried.add(replica.url)
            if failure.eject:
                self.pool.eject(replica, failure.detail or failure.message)
            raise
        finally:
            if plan is not None:
                plan.release()
            await self.pool.release(replica, adapter.triton_model)

    async def _call(self, replica: Replica, run: Run, job: Job, stream: bool, control: RunControl) -> None:
        """One call to Triton. Raises Failure for what Triton (or the connection to it)
        did wrong; whatever else goes wrong is not the replica's fault."""
        remaining = max(0.001, job.deadline - time.time())
        if not run.decoupled:
            await self._unary(replica, run, job, stream, control, remaining)
            return
        request = {
            "model_name": run.triton_model,
            "inputs": run.inputs(stream),
            "outputs": run.outputs(),
            "request_id": job.request_id,
            "timeout": int(remaining * 1e6),
        }
        responses = replica.client.stream_infer(
            _once(request), stream_timeout=remaining, headers=tracing.headers(job.payload)
        )
        adapter = self.registry.adapters[job.model]
        emitter = control.emitter

        def abort() -> None:
            responses.cancel()
            if adapter.stop_model:
                self.background(self._stop(replica, adapter.stop_model, job.request_id))

        control.abort = abort
        if control.cancel_requested:
            control.stop()
        try:
            iterator = responses.__aiter__()
            while True:
                try:
                    result, error = await iterator.__anext__()
                except StopAsyncIteration:
                    break
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    raise classify(exc) from exc
                if error is not None:
                    raise classify(error)
                self._first(control)
                try:
                    pieces = run.take(result)
                except RunError as exc:
                    raise Failure(exc.code, exc.message, retryable=False) from exc
                if pieces and emitter is not None:
                    await emitter.add(pieces)
                if run.done:
                    abort()  # the engine stops generating what nobody reads
                    break
        except asyncio.CancelledError:
            control.stop()
            raise
        finally:
            control.abort = None
        if control.cancel_requested:
            return
        rest = run.flush()
        if rest and emitter is not None:
            await emitter.add(rest)

    async def _unary(
        self, replica: Replica, run: Run, job: Job, stream: bool, control: RunControl, remaining: float
    ) -> None:
        """One request, one answer: a call of its own, or rows of calls shared with other
        requests of its model (the embedding models: replicas/batching.py). A many-input
        request goes as rows whether calls are shared or not: its rows may be more than
        one call takes."""
        row = run.batch_row()
        if row is not None and (self.batched is not None or row.values):
            batcher = self.batched if self.batched is not None else self.split
            answer = batcher.infer(replica, run.triton_model, row, job.request_id, remaining)
        else:
            answer = replica.client.infer(
                run.triton_model,
                run.inputs(stream),
                outputs=run.outputs(),
                request_id=job.request_id,
                client_timeout=remaining,
                timeout=int(remaining * 1e6),
                headers=tracing.headers(job.payload),
            )
        # Awaited in the run's own task (no task for the call): an abort cancels this task
        # at this await, the only place it can be while control.abort is set.
        task = asyncio.current_task()
        aborted = False

        def abort() -> None:
            nonlocal aborted
            if task is not None and not aborted:
                aborted = True
                task.cancel()

        control.abort = abort
        try:
            result = await answer
        except asyncio.CancelledError:
            if aborted and control.cancel_requested and task is not None and task.uncancel() == 0:
                return  # asked to cancel (nothing else cancelled the task): the run ends canceled
            raise
        except Exception as exc:
            raise classify(exc) from exc
        finally:
            control.abort = None
        self._first(control)
        run.take(result)

    @staticmethod
    def _first(control: RunControl) -> None:
        if control.first_response_s is None:
            control.first_response_s = time.monotonic() - control.started
            tracing.mark("replica.first_response")  # from the replica call's start

    async def _stop(self, replica: Replica, model: str, request_id: str) -> None:
        """Tell a generator behind an ensemble to end request_id (ensembles do not pass
        cancellation on to a running step)."""
        request = {
            "model_name": model,
            "inputs": stop_inputs(),
            "request_id": request_id,
        }
        try:
            async with asyncio.timeout(5):
                async for _ in replica.client.stream_infer(_once(request)):
                    pass
        except Exception as exc:
            log.warning("stop for %s on %s failed: %s", request_id, replica.url, exc)


def stop_inputs() -> list[Any]:
    """TensorRT-LLM's stop request: `stop` set, and the required inputs as placeholders."""
    return [
        tensor("input_ids", np.array([[0]], dtype=np.int32), "INT32"),
        tensor("input_lengths", np.array([[1]], dtype=np.int32), "INT32"),
        tensor("request_output_len", np.array([[1]], dtype=np.int32), "INT32"),
        tensor("stop", np.array([[True]]), "BOOL"),
    ]


async def _once(request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    yield request
