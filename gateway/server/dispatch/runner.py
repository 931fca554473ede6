"""Running one started request on the replicas: choose a replica, send the request,
relay what comes back as token events, and build the record.

A retryable failure (replica gone, model not ready there) is tried again on another
replica while one exists, else on the same one once it is back, with backoff and
within the request's deadline; a bad request fails at once with Triton's reason. A
streamed LLM request on the engine path that already sent tokens resumes from them
(the new run continues the sequence); other models retry only before anything was
sent."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt, wait_exponential_jitter

from gateway.protocol import ErrorInfo, ResultRecord, Route, State
from gateway.server.dispatch.emitter import StaleRun, TokenEmitter
from gateway.server.dispatch.failures import Failure, classify
from gateway.server.models import InvalidInput, ModelAdapter, ModelRegistry, Run
from gateway.server.models.base import Resume, tensor
from gateway.server.queue.jobs import Job, JobStore
from gateway.server.replicas import Replica, ReplicaPool
from gateway.server.routing.router import Router
from gateway.server.settings import GatewaySettings

log = logging.getLogger(__name__)


@dataclass
class RunControl:
    """Shared between a run and whoever may stop it (cancel, shutdown, fencing)."""

    request_id: str
    attempt: int
    cancel_requested: bool = False
    stale: bool = False
    first_response_s: float | None = None
    replica: str | None = None
    route: Route | None = None
    started: float = field(default_factory=time.monotonic)
    run: Run | None = None
    # Ends the Triton call in flight at once.
    abort: Callable[[], None] | None = None
    # Called once the run holds a replica slot (the dispatcher counts waiting runs).
    on_acquired: Callable[[], None] | None = None

    def stop(self) -> None:
        abort, self.abort = self.abort, None
        if abort is not None:
            abort()


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

    async def run(self, job: Job, control: RunControl) -> ResultRecord:
        try:
            adapter = self.registry.get(job.model)
            prepared = adapter.validate(job.payload["inputs"], job.payload.get("parameters", {}))
        except InvalidInput as exc:
            return job.record(State.FAILED, error=ErrorInfo(code=exc.code, message=exc.message))
        stream = bool(job.payload.get("stream", False)) and adapter.decoupled
        resume = self._resume(job, adapter, prepared, stream)
        if isinstance(resume, ResultRecord):
            return resume
        emitter = (
            TokenEmitter(
                self.jobs,
                job.request_id,
                control.attempt,
                window_s=self.settings.token_window_ms / 1000,
                max_pieces=self.settings.token_window_max,
                on_cancel=lambda: self._cancel(control),
            )
            if stream
            else None
        )
        failures: list[Failure] = []
        tried: set[str] = set()

        def retryable(exc: BaseException) -> bool:
            if isinstance(exc, StaleRun | asyncio.CancelledError | TimeoutError):
                return False
            failure = classify(exc)
            run = control.run
            return (
                failure.retryable
                and not control.cancel_requested
                and (run is None or not run.produced or adapter.resumable)
            )

        def remember(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None:
                log.warning("request %s failed on %s (%s); retrying", job.request_id, control.replica, classify(exc))

        retrying = AsyncRetrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(self.settings.max_retries + 1),
            wait=wait_exponential_jitter(initial=0.1, max=2.0),
            before_sleep=remember,
            reraise=True,
        )
        try:
            async for attempt in retrying:
                with attempt:
                    await self._attempt(job, adapter, prepared, stream, emitter, control, tried, failures, resume)
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
        except Exception as exc:
            failure = classify(exc)
            if control.cancel_requested:
                return self.partial(job, control, State.CANCELED, None)
            status = State.EXPIRED if failure.code == "deadline_exceeded" else State.FAILED
            return self.partial(job, control, status, ErrorInfo(code=failure.code, message=failure.message))
        finally:
            if emitter is not None:
                emitter.discard()
        if control.cancel_requested:
            return self.partial(job, control, State.CANCELED, None)
        return self.partial(job, control, State.SUCCEEDED, None)

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
        adapter = self.registry.adapters.get(job.model)
        return job.record(
            status,
            outputs=outputs or None,
            error=error,
            replica=control.replica,
            route=control.route,
            usage=usage,
            ttft_s=control.first_response_s,
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
        emitter: TokenEmitter | None,
        control: RunControl,
        tried: set[str],
        failures: list[Failure],
        resume: Resume | None,
    ) -> None:
        plan = await self.router.plan(adapter, prepared) if self.router is not None else None
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
            replica=replica.url, policy="least_outstanding", reason="load", load=float(replica.inflight)
        )
        run = adapter.new_run(prepared, resume)
        previous, control.run = control.run, run
        if previous is not None and previous.produced and adapter.resumable:
            run.carry_from(previous)
        try:
            await self._call(replica, run, job, stream, emitter, control)
            if emitter is not None:
                await emitter.close()
        except (StaleRun, asyncio.CancelledError):
            raise
        except Exception as exc:
            failure = classify(exc)
            failures.append(failure)
            tried.add(replica.url)
            if failure.eject:
                self.pool.eject(replica, failure.message)
            if emitter is not None:
                await emitter.close()  # what arrived before the failure is kept
            raise failure from exc
        finally:
            if plan is not None:
                plan.release()
            await self.pool.release(replica)

    async def _call(
        self, replica: Replica, run: Run, job: Job, stream: bool, emitter: TokenEmitter | None, control: RunControl
    ) -> None:
        remaining = max(0.001, job.deadline - time.time())
        inputs = run.inputs(stream)
        if not run.decoupled:
            call = asyncio.ensure_future(
                replica.client.infer(
                    run.triton_model,
                    inputs,
                    outputs=run.outputs(),
                    request_id=job.request_id,
                    client_timeout=remaining,
                    timeout=int(remaining * 1e6),
                )
            )
            control.abort = call.cancel
            try:
                result = await call
            except asyncio.CancelledError:
                if control.cancel_requested:
                    return
                raise
            finally:
                control.abort = None
            self._first(control)
            run.take(result)
            return
        request = {
            "model_name": run.triton_model,
            "inputs": inputs,
            "outputs": run.outputs(),
            "request_id": job.request_id,
            "timeout": int(remaining * 1e6),
        }
        responses = replica.client.stream_infer(_once(request), stream_timeout=remaining)
        adapter = self.registry.adapters[job.model]

        def abort() -> None:
            responses.cancel()
            if adapter.stop_model:
                self.background(self._stop(replica, adapter.stop_model, job.request_id))

        control.abort = abort
        if control.cancel_requested:
            control.stop()
        try:
            async for result, error in responses:
                if error is not None:
                    raise classify(error)
                self._first(control)
                pieces = run.take(result)
                if pieces and emitter is not None:
                    await emitter.add(pieces)
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

    @staticmethod
    def _first(control: RunControl) -> None:
        if control.first_response_s is None:
            control.first_response_s = time.monotonic() - control.started

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
