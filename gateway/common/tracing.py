"""A request's life as an OpenTelemetry trace, across the processes it passes through.

Its spans, in the order the request lives them (names as exported):

    accept                  the HTTP call's admission (spine.accept), a child of the
      accept.tokenize       client's `traceparent` when it sent one: validation and token
      accept.quotas         counting, the tenant's rate limits,
      submit                SUBMIT (queued, or started at once)
    start                   from submission until a process started it (queue wait, TAKE)
    run                     the run, in whichever process took it (spine.run)
      replica.call          the call to the Triton replica (dispatch/runner.py); Triton gets
        replica.first_response  the call's `traceparent` (gRPC metadata), so Triton's own
        emit.first_event    OpenTelemetry spans join the trace; first_response ends at the
                            replica's first response, first_event when the first token
                            event is in Redis (dispatch/emitter.py)
    finish                  FINISH (spine.finish)
    binder.store            the binder storing the result (binder/archive.py)

The context travels inside the request: accept puts the W3C `traceparent` of its span into
the request's payload (through Redis to whichever process runs it) and its record (to the
binder), as python-arq's opentelemetry support puts a job's context into the job.
Embedding requests whose rows share a Triton call (replicas/batching.py) send Triton no
traceparent: one call serves several traces.

Configuration is OpenTelemetry's own environment: tracing is on when OTEL_TRACES_EXPORTER
names an exporter (`otlp`, `console`) or an OTLP endpoint is set
(OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and OTEL_SDK_DISABLED is
not `true`. OTLP goes over HTTP/protobuf unless OTEL_EXPORTER_OTLP(_TRACES)_PROTOCOL says
`grpc`; the exporters, OTEL_TRACES_SAMPLER, OTEL_BSP_* and OTEL_SERVICE_NAME are read by
the SDK. Off (the default) no SDK is loaded and no tracer provider installed: the hooks
return a shared null context manager or nothing, and the decorated stages are the
undecorated functions. Only a client's `traceparent` is still passed on, unchanged, to
Triton (and only for the calls that sent one)."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from contextvars import ContextVar
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Tracer
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

HEADER = "traceparent"  # the W3C header, the payload's key and the gRPC metadata key
# Version 00 of W3C Trace Context; ids of all zeros are invalid.
VALID = re.compile(r"00-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
DEFAULT_SERVICE = "triton-gateway"

P = ParamSpec("P")
R = TypeVar("R")

_NULL: AbstractContextManager[None] = nullcontext()
_NONE: Mapping[str, str] = {}  # shared and never written
_PROPAGATOR = TraceContextTextMapPropagator()
# Tracing off: the traceparent the client sent with the call being handled, passed on as is.
_client: ContextVar[str | None] = ContextVar("traceparent", default=None)

_tracer: Tracer | None = None
_checked = False


def configured(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether OpenTelemetry's environment asks for traces to be exported."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    names = _exporter_names(environ)
    if names:
        return any(name != "none" for name in names)
    return bool(environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def _exporter_names(environ: Mapping[str, str]) -> list[str]:
    return [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]


def setup(service: str = DEFAULT_SERVICE) -> bool:
    """Install the SDK's tracer provider with the configured exporters, once per process
    (service: service.name unless OTEL_SERVICE_NAME sets it). Whether tracing is on."""
    global _tracer, _checked
    if _checked:
        return _tracer is not None
    _checked = True
    if not configured():
        return False
    # The SDK is imported only when tracing is on.
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service})
    # flushed at exit (shutdown_on_exit)
    provider = TracerProvider(resource=resource, sampler=sampler(os.environ))
    for exporter in _exporters():
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("triton-gateway")
    log.info("tracing on: %s", ", ".join(_exporter_names(os.environ)) or "otlp")
    return True


def sampler(environ: Mapping[str, str]) -> Any:
    """OTEL_TRACES_SAMPLER (and _ARG), with one change: a trace begun by a client (a remote
    parent) is sampled by the configured sampler's own rule, whatever the client's sampled
    flag says, so a client cannot make every span of its calls kept (or dropped). Spans
    under a parent of this process follow that parent, as ParentBased's do."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, Sampler, TraceIdRatioBased

    name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
    rule = name.removeprefix("parentbased_")
    root: Sampler
    if rule == "always_off":
        root = ALWAYS_OFF
    elif rule == "traceidratio":
        try:
            ratio = float(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"))
        except ValueError:
            ratio = 1.0
        root = TraceIdRatioBased(min(max(ratio, 0.0), 1.0))
    else:
        if rule != "always_on":
            log.warning("OTEL_TRACES_SAMPLER: %r is not a sampler this process knows: always_on", name)
        root = ALWAYS_ON
    return ParentBased(root, remote_parent_sampled=root, remote_parent_not_sampled=root)


def _exporters() -> Iterator[Any]:
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    for name in _exporter_names(os.environ) or ["otlp"]:
        if name == "otlp":
            protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
                "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
            )
            if protocol.strip().lower() == "grpc":
                try:
                    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
                except ImportError:  # the binder's install has the HTTP exporter only
                    log.warning("OTLP over gRPC needs opentelemetry-exporter-otlp-proto-grpc: not exporting")
                    continue
                yield Grpc()  # endpoint, headers, timeout: OTEL_EXPORTER_OTLP_*
            else:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

                yield Http()
        elif name == "console":
            yield ConsoleSpanExporter()  # one JSON object a span, on stdout
        elif name != "none":
            log.warning("OTEL_TRACES_EXPORTER: %r is not an exporter this process knows (otlp, console)", name)


def _active() -> Tracer | None:
    if not _checked:
        setup()
    return _tracer


def enabled() -> bool:
    return _active() is not None


# -- the hooks ------------------------------------------------------------------------------


def span(name: str, kind: SpanKind = SpanKind.INTERNAL) -> AbstractContextManager[Any]:
    """A span of the current trace around a block; off: a shared null context."""
    tracer = _tracer if _checked else _active()
    if tracer is None:
        return _NULL
    return tracer.start_as_current_span(name, kind=kind)


def traced(
    name: str, kind: SpanKind = SpanKind.INTERNAL
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """A span around each call of an async function; the function itself when tracing is
    not configured (the environment is read as the module that uses it is imported)."""

    def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not configured():
            return function

        @wraps(function)
        async def spanned(*args: P.args, **kwargs: P.kwargs) -> R:
            with span(name, kind):
                return await function(*args, **kwargs)

        return spanned

    return decorate


def of_job(
    name: str, *, job_at: int = 1, queued: bool = False, kind: SpanKind = SpanKind.INTERNAL
) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """A span around each call of an async function of a started request (its Job the
    positional argument job_at), in the request's trace (its payload's traceparent);
    queued: a `start` span first, from the request's submission until now. The function
    itself when tracing is not configured."""

    def decorate(function: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        if not configured():
            return function

        @wraps(function)
        async def spanned(*args: P.args, **kwargs: P.kwargs) -> R:
            job: Any = args[job_at]
            since = job.created_at if queued else None
            with continued(job.payload, name, since=since, kind=kind) as current:
                if current is not None:
                    current.set_attribute("gateway.request_id", job.request_id)
                    current.set_attribute("gateway.model", job.model)
                    current.set_attribute("gateway.attempt", job.attempts)
                return await function(*args, **kwargs)

        return spanned

    return decorate


@contextmanager
def continued(
    payload: Mapping[str, Any], name: str, *, since: float | None = None, kind: SpanKind = SpanKind.CONSUMER
) -> Iterator[Any]:
    """A span in the trace a request's payload carries (a new trace without one); since
    (a wall-clock time): a `start` span from then until now first. Off: yields None."""
    tracer = _active()
    if tracer is None:
        yield None
        return
    parent = _extract(payload.get(HEADER))
    if since is not None:
        tracer.start_span("start", parent, kind=SpanKind.INTERNAL, start_time=int(since * 1e9)).end()
    with tracer.start_as_current_span(name, parent, kind=kind) as current:
        yield current


def _extract(traceparent: Any) -> otel_context.Context | None:
    if not isinstance(traceparent, str):
        return None
    return _PROPAGATOR.extract({HEADER: traceparent})


def take(value: bytes | None) -> Callable[[], None] | None:
    """The `traceparent` header of an incoming call (the edge): on, its context becomes the
    current one (the call's spans are its children); off, it is kept to pass on to Triton.
    What undoes that, or None when the header is absent or not valid W3C."""
    if value is None:
        return None
    text = value.decode("latin-1").strip()
    if not VALID.fullmatch(text):
        return None
    if _active() is None:
        reset = _client.set(text)
        return lambda: _client.reset(reset)
    token = otel_context.attach(_PROPAGATOR.extract({HEADER: text}))
    return lambda: otel_context.detach(token)


def carrier() -> Mapping[str, str]:
    """What goes into a request's payload so that whoever runs it continues the trace: the
    current span's traceparent; off, the client's (the shared empty mapping without one)."""
    if _active() is None:
        given = _client.get()
        return _NONE if given is None else {HEADER: given}
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out)
    return out


def headers(payload: Mapping[str, Any]) -> dict[str, str] | None:
    """The metadata of a call to Triton: the current span's traceparent; off, the one the
    request carries (a client's), None without one."""
    if _active() is None:
        given = payload.get(HEADER)
        return {HEADER: given} if given else None
    out: dict[str, str] = {}
    _PROPAGATOR.inject(out)
    return out or None


def annotate(key: str, value: str | int | float | bool) -> None:
    """An attribute of the current span (nothing when off)."""
    if _tracer is not None:
        trace.get_current_span().set_attribute(key, value)


def mark(name: str) -> None:
    """A span from the start of the current span until now (its first response, say)."""
    if _tracer is None:
        return
    start = getattr(trace.get_current_span(), "start_time", None)
    if start is not None:
        _tracer.start_span(name, start_time=start).end()


def clock() -> int:
    """Now, in the nanoseconds spans are timed in (0 when off: nothing is timed)."""
    return time.time_ns() if _active() is not None else 0


def consumed(name: str, traceparents: Iterable[str | None], since: int) -> None:
    """A finished consumer span from `since` (clock()) until now in each trace named (the
    binder storing a batch of results: one span per result that carries a trace)."""
    tracer = _active()
    if tracer is None:
        return
    for traceparent in traceparents:
        if traceparent:
            tracer.start_span(name, _extract(traceparent), kind=SpanKind.CONSUMER, start_time=since).end()
