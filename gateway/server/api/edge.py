"""The gateway's one ASGI middleware, in front of the FastAPI app. For every HTTP call it:

- takes the X-Request-ID (from nginx or the client, when sane; else a new one), binds it
  into the log context as `trace_id`, and returns it (gateway.server.api.request_id); takes
  a W3C `traceparent` as the parent of the call's spans (gateway.common.tracing);
- checks the API key of every path but the public ones, from the headers, before a byte of
  the body is read (a caller without a valid key cannot make the gateway parse its JSON or
  spool its upload), and keeps who calls in the request's state for the routes (the
  `caller` dependency and the hot routes reuse it: one check a request); then a path's
  check before the body (POST /v1/files: the upload reserved against its tenant's quota),
  whose hold it tells the body's size as it arrives and closes once the call has ended;
- limits the body: over max_bytes (declared or streamed) is 413, not arriving within
  body_timeout_s is 408 (slow senders cannot hold a worker); a JSON body must be UTF-8;
  a body sent with Content-Encoding gzip or zstd is decompressed as it arrives, the limit
  applying to what it decompresses to, its ratio to what was received capped past its
  first MiB (MAX_COMPRESSION_RATIO), a large chunk decoded in a worker thread
  (gateway.server.api.content_encoding); a JSON body's values are counted as it arrives
  (MAX_JSON_VALUES: what json.loads would spend the loop's time on);
- sheds load: past MAX_INFLIGHT_REQUESTS requests begun and not yet answering, or while
  the event loop runs more than MAX_LOOP_LAG_S behind (gateway.server.api.loop_probe), a
  new one is 503 `overloaded` with Retry-After at once, before its key is checked (health
  and metrics exempt);
- adds the headers the calls made for the caller left (x-ratelimit-*);
- counts it by route template, method and status, times it, and logs one access line;
- and serves the hot routes, POST /infer and GET /results/<id>, itself
  (gateway.server.api.hot) without FastAPI's routing and dependency solving; everything
  else goes to FastAPI (which declares the hot routes too, for the OpenAPI document and
  its router's 405s and redirects, and has them answered by the same code).

One layer instead of four: every request crosses it once."""

from __future__ import annotations

import asyncio
import codecs
import logging
import re
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, Histogram
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.common import tracing
from gateway.common.logs import bind_request_ids, clear_request_ids
from gateway.server.api.content_encoding import Decoder, decode, decoder_for
from gateway.server.api.errors import BodyRefused, ErrorRenderer
from gateway.server.api.hot import HotRoutes
from gateway.server.api.loop_probe import LoopProbe
from gateway.server.api.request_id import HEADER, TRACE_HEADER, accepted_trace_id, bind_trace_id
from gateway.server.api.tenancy import identify
from gateway.server.metrics import GatewayMetrics

if TYPE_CHECKING:
    from gateway.server.services import Services
    from gateway.server.settings import GatewaySettings

access_log = logging.getLogger("gateway.access")


def loggable_path(scope: Scope) -> str:
    """The path as the client sent it (still percent-encoded), with any byte outside
    printable ASCII escaped: a decoded %0A would start a forged line in the console log."""
    raw = scope.get("raw_path") or scope["path"].encode()
    return raw.decode("latin-1").encode("unicode_escape").decode("ascii")


QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})
UNMATCHED_ROUTE = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_REQUEST_ID = HEADER.lower().encode()
_TRACE_HEADER = TRACE_HEADER.lower().encode()
_CONTENT_LENGTH = b"content-length"
_TRACEPARENT = tracing.HEADER.encode()
_CONTENT_TYPE = b"content-type"
_CONTENT_ENCODING = b"content-encoding"
_AUTHORIZATION = b"authorization"
_X_API_KEY = b"x-api-key"  # Anthropic's clients send the key here
_TRANSFER_ENCODING = b"transfer-encoding"
# Paths served without a key: liveness, readiness and the browser page (whose API calls
# send the key the user types); /metrics and the API documents as settings say.
PUBLIC_PATHS = frozenset({"/healthz", "/readyz", "/ui"})
PUBLIC_PREFIXES = ("/ui/",)
METRICS_PATH = "/metrics"
DOCS_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
# A compressed body's first MiB decompressed is free of the ratio cap: small JSON bodies
# compress far better than 20x, and a MiB decodes and parses in milliseconds.
RATIO_FREE_BYTES = 1 << 20
_JSON_VALUE_MARKS = (b",", b":", b"[", b"{")


class _Limits:
    """The settings the edge reads on every call, read once."""

    def __init__(self, settings: GatewaySettings) -> None:
        self.ratio = settings.max_compression_ratio
        self.frames = settings.max_compressed_frames
        self.json_values = settings.max_json_values
        self.inflight = settings.max_inflight_requests
        self.loop_lag = settings.max_loop_lag_s
        self.retry_after = str(settings.retry_after_s)


def _templates(routes: Iterable[Any]) -> Iterator[tuple[re.Pattern[str], str]]:
    """(path regex, template) of every route, through FastAPI's included routers."""
    for route in routes:
        if hasattr(route, "effective_route_contexts"):  # an included router (FastAPI >= 0.16x)
            yield from _templates(route.effective_route_contexts())
        elif getattr(route, "path_regex", None) is not None and getattr(route, "path_format", None):
            yield route.path_regex, route.path_format


def _is_json(content_type: bytes | None) -> bool:
    if content_type is None:
        return True  # FastAPI reads a body without a content type as JSON
    main = content_type.split(b";", 1)[0].strip().lower()
    return main == b"application/json" or (main.startswith(b"application/") and main.endswith(b"+json"))


def _has_body(headers: dict[bytes, bytes]) -> bool:
    length = headers.get(_CONTENT_LENGTH)
    return _TRANSFER_ENCODING in headers or (length is not None and length not in (b"0", b""))


class BodyHold(Protocol):
    """What a check before the body holds for its call (an upload's reservation of its
    tenant's quota): told the body's size so far as it arrives (decompressed), which may
    refuse it (raises BodyRefused); closed once the call has ended, however it ended. The
    route finds it in the request's state (`body_hold`)."""

    async def arrived(self, size: int) -> None: ...

    async def close(self) -> None: ...


# A check of a call before its body is read: (the services, the caller, the declared body
# size or None when it is not declared); raises what the call is refused with, or returns
# what it holds for the call (None: nothing).
BeforeBody = Callable[["Services", Any, int | None], Awaitable[BodyHold | None]]


async def _closed(hold: BodyHold) -> None:
    """Close what a check held for a call that ended (shielded: a cancelled call still
    releases it; one that cannot be closed now lapses by itself)."""
    try:
        await asyncio.shield(hold.close())
    except Exception:
        logging.getLogger(__name__).warning("could not close what the call held", exc_info=True)


class Edge:
    def __init__(
        self,
        app: ASGIApp,
        *,
        metrics: GatewayMetrics,
        errors: ErrorRenderer,
        max_bytes: int,
        body_timeout_s: float,
        uploads: dict[str, tuple[int, float]] | None = None,
        before_body: dict[str, BeforeBody] | None = None,
        hot: HotRoutes | None = None,
        services: Callable[[], Services] | None = None,
        long_polls: Callable[[], int] = lambda: 0,
    ) -> None:
        self.app = app
        # The app's services (its settings, the key store): set by its lifespan.
        self.services = services or (lambda: app.state.services)  # type: ignore[attr-defined]
        self.metrics = metrics
        self.errors = errors
        self.max_bytes = max_bytes
        self.body_timeout_s = body_timeout_s
        # Paths that take larger bodies (file uploads): path -> (max bytes, body timeout).
        self.uploads = uploads or {}
        # Paths whose caller and declared body size are checked before the body is read
        # (an upload past the tenant's quota is refused before a byte of it is spooled).
        self.before_body = before_body or {}
        self.hot = hot
        # The long polls waiting now (the event hub's), left out of the overload shed's count.
        self.long_polls = long_polls
        self._routes: list[tuple[re.Pattern[str], str]] | None = None
        self._counters: dict[tuple[str, str, int], Counter] = {}
        self._timers: dict[tuple[str, str], Histogram] = {}
        self.probe = LoopProbe(metrics.registry)
        self._limits: _Limits | None = None
        self.inflight = 0  # requests begun and not yet answering (the overload shed's count)
        Gauge(
            "gateway_http_inflight",
            "HTTP requests begun and not yet answering (MAX_INFLIGHT_REQUESTS sheds beyond)",
            registry=metrics.registry,
        ).set_function(lambda: self.inflight)

    def limits(self) -> _Limits:
        if self._limits is None:
            self._limits = _Limits(self.services().settings)
        return self._limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.probe.ensure_running()
        limits = self.limits()
        headers = dict(scope["headers"])
        trace_id = accepted_trace_id(headers.get(_REQUEST_ID))
        untrace = tracing.take(headers.get(_TRACEPARENT))  # the client's W3C trace context
        reset = bind_trace_id(trace_id)
        bind_request_ids(trace_id=trace_id)
        started = time.perf_counter()
        path, method = scope["path"], scope["method"]
        scope.setdefault("state", {})
        status = 500  # what the client gets if the app raises before answering
        route = self.hot.match(method, path) if self.hot is not None else None
        max_bytes, body_timeout_s = self.uploads.get(path, (self.max_bytes, self.body_timeout_s))
        received = 0
        decoded = 0  # bytes a compressed body decompressed to so far
        decoder: Decoder | None = None
        json_values = 0
        hold: BodyHold | None = None  # what the path's check before the body holds for the call
        body_done = False
        response_started = False
        holds_slot = False  # counted in self.inflight until its answer starts
        utf8 = codecs.getincrementaldecoder("utf-8")() if _is_json(headers.get(_CONTENT_TYPE)) else None
        body_deadline = asyncio.get_running_loop().time() + body_timeout_s

        async def limited_receive() -> Message:
            nonlocal received, decoded, body_done, json_values
            if body_done:  # waiting for a disconnect while the response streams: no limit
                return await receive()
            try:
                async with asyncio.timeout_at(body_deadline):
                    message = await receive()
            except TimeoutError:
                raise BodyRefused(
                    408, "request_timeout", f"the request body did not arrive within {body_timeout_s:g}s"
                ) from None
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                received += len(chunk)
                if received > max_bytes:
                    raise BodyRefused(413, "payload_too_large", f"request body is over {max_bytes} bytes")
                body_done = not message.get("more_body", False)
                if decoder is not None:
                    allowed = max(int(limits.ratio * received), RATIO_FREE_BYTES)
                    chunk = await decode(decoder, chunk, min(max_bytes, allowed) - decoded)
                    decoded += len(chunk)
                    if decoded > max_bytes:
                        raise BodyRefused(
                            413, "payload_too_large", f"request body is over {max_bytes} bytes decompressed"
                        )
                    if decoded > allowed:
                        raise BodyRefused(
                            413,
                            "compression_ratio_too_high",
                            f"the body decompresses to more than {limits.ratio:g} times its size "
                            f"(past its first {RATIO_FREE_BYTES} bytes): send it less compressed",
                        )
                    if body_done:
                        decoder.finish()
                    message = {**message, "body": chunk}
                if hold is not None:
                    await hold.arrived(decoded if decoder is not None else received)
                if utf8 is not None:
                    try:
                        utf8.decode(chunk, final=body_done)
                    except UnicodeDecodeError:
                        raise BodyRefused(422, "invalid_json", "the body is not UTF-8: JSON bodies are UTF-8") from None
                    # UTF-16 or UTF-32 without a byte-order mark decodes as UTF-8 (its zero
                    # bytes are NULs), and json.loads would read it: JSON text has no NUL.
                    if b"\x00" in chunk:
                        raise BodyRefused(422, "invalid_json", "the body is not UTF-8: JSON bodies are UTF-8")
                    # An upper bound on the values json.loads would build (strings' commas
                    # count too), refused before any of them is parsed.
                    json_values += sum(chunk.count(mark) for mark in _JSON_VALUE_MARKS)
                    if json_values > limits.json_values:
                        raise BodyRefused(
                            413,
                            "too_many_json_values",
                            f"the JSON body holds over {limits.json_values} values (commas, colons and brackets)",
                        )
            else:
                body_done = True
            return message

        async def edge_send(message: Message) -> None:
            nonlocal status, response_started, holds_slot
            if message["type"] == "http.response.start":
                status = message["status"]
                response_started = True
                if holds_slot:
                    holds_slot = False
                    self.inflight -= 1
                out = list(message.get("headers", []))
                names = {name.lower() for name, _ in out}
                # A /v1 answer names its durable request in X-Request-ID, as OpenAI's does:
                # the call's own id goes to X-Trace-ID then.
                out.append((_TRACE_HEADER if _REQUEST_ID in names else _REQUEST_ID, trace_id.encode()))
                who = scope["state"].get("caller")
                if who is not None and who.headers:
                    out.extend((k.encode(), v.encode()) for k, v in who.headers.items())
                message = {**message, "headers": out}
            await send(message)

        try:
            if path not in QUIET_PATHS:
                # A long poll holds a place of the event hub's pool, which bounds it by
                # tenant: it is no work in flight, and no tenant's polls shed another's calls.
                if limits.inflight and self.inflight - self.long_polls() >= limits.inflight:
                    message = f"this gateway process is serving {limits.inflight} requests, its most"
                    await self._shed(scope, limits, headers, limited_receive, edge_send, message)
                    return
                if limits.loop_lag and self.probe.lag > limits.loop_lag:
                    message = f"this gateway process runs {self.probe.lag * 1000:.0f} ms behind"
                    await self._shed(scope, limits, headers, limited_receive, edge_send, message)
                    return
                self.inflight += 1
                holds_slot = True
            declared = headers.get(_CONTENT_LENGTH)
            if declared is not None and declared.isdigit() and int(declared) > max_bytes:
                raise BodyRefused(413, "payload_too_large", f"request body is over {max_bytes} bytes")
            refusal = await self._authenticate(scope, headers.get(_AUTHORIZATION), headers.get(_X_API_KEY))
            check = self.before_body.get(path) if refusal is None and method == "POST" else None
            if check is not None:
                refusal, hold = await self._checked_before_body(scope, check, declared)
            if refusal is not None:
                if _has_body(headers):
                    # The body was never read: closing the connection after the answer spares
                    # the server reading (and discarding) what the client still sends.
                    refusal.headers["connection"] = "close"
                await refusal(scope, limited_receive, edge_send)
            else:
                # The key first: an encoding not served is refused only to a known caller.
                decoder = decoder_for(headers.get(_CONTENT_ENCODING), limits.frames)
                if decoder is not None:  # the routes see the body decompressed, its length unknown
                    drop = (_CONTENT_ENCODING, _CONTENT_LENGTH)
                    scope["headers"] = [(k, v) for k, v in scope["headers"] if k.lower() not in drop]
                if route is not None and self.hot is not None:
                    await self.hot.handle(route, scope, limited_receive, edge_send)
                else:
                    await self.app(scope, limited_receive, edge_send)
        except BodyRefused as refused:
            if not response_started:
                answer = self.errors.response(path, refused.status, refused.code, refused.message, refused.details)
                await answer(scope, limited_receive, edge_send)
        finally:
            if hold is not None:
                await _closed(hold)
            if holds_slot:
                self.inflight -= 1
            template = route.template if route is not None else self.route_template(scope)
            self._count(template, method, status, time.perf_counter() - started)
            level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
            if access_log.isEnabledFor(level):
                elapsed_ms = (time.perf_counter() - started) * 1000
                access_log.log(level, "%s %s %d %.1fms", method, loggable_path(scope), status, elapsed_ms)
            clear_request_ids()
            reset()
            if untrace is not None:
                untrace()

    async def _shed(
        self, scope: Scope, limits: _Limits, headers: dict[bytes, bytes], receive: Receive, send: Send, why: str
    ) -> None:
        """503 overloaded at once: nothing read, nothing checked (the answer costs less than
        the key's check would), so what the process has begun finishes sooner."""
        retry = {"Retry-After": limits.retry_after}
        if _has_body(headers):
            retry["connection"] = "close"
        answer = self.errors.response(scope["path"], 503, "overloaded", f"{why}: try again shortly", None, retry)
        await answer(scope, receive, send)

    def public(self, path: str, settings: GatewaySettings) -> bool:
        """Whether a path is served without a key."""
        if path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES):
            return True
        if path == METRICS_PATH:
            return settings.public_metrics
        return path in DOCS_PATHS and settings.public_docs

    async def _checked_before_body(
        self, scope: Scope, check: BeforeBody, declared: bytes | None
    ) -> tuple[Response | None, BodyHold | None]:
        """The answer to give instead of reading the body, when the path's check refuses
        the caller's call at its declared size (None: it goes on), and what the check holds
        for the call (kept in the request's state as `body_hold` too)."""
        size = int(declared) if declared is not None and declared.isdigit() else None
        try:
            hold = await check(self.services(), scope["state"]["caller"], size)
        except Exception as exc:
            answer = self.errors.of(scope["path"], scope["method"], exc)
            return answer if answer is not None else self.errors.unexpected(scope["path"], scope["method"], exc), None
        scope["state"]["body_hold"] = hold
        return None, hold

    async def _authenticate(
        self, scope: Scope, authorization: bytes | None, x_api_key: bytes | None = None
    ) -> Response | None:
        """Who calls, into the request's state; the answer to give instead when nobody
        (401) or when the key store is away (503); None when the call goes on."""
        svc = self.services()
        if self.public(scope["path"], svc.settings):
            return None
        try:
            scope["state"]["caller"] = await identify(
                svc,
                authorization.decode("latin-1") if authorization is not None else None,
                x_api_key.decode("latin-1") if x_api_key is not None else None,
            )
        except Exception as exc:
            answer = self.errors.of(scope["path"], scope["method"], exc)
            return answer if answer is not None else self.errors.unexpected(scope["path"], scope["method"], exc)
        return None

    def _count(self, route: str, method: str, status: int, seconds: float) -> None:
        method = method if method in _METHODS else "other"
        counter = self._counters.get((route, method, status))
        if counter is None:
            counter = self._counters[(route, method, status)] = self.metrics.http_requests.labels(
                route, method, str(status)
            )
        counter.inc()
        timer = self._timers.get((route, method))
        if timer is None:
            timer = self._timers[(route, method)] = self.metrics.http_latency.labels(route, method)
        timer.observe(seconds)

    def route_template(self, scope: Scope) -> str:
        """The template of the route that handled the request ("/results/{request_id}").
        A request refused before routing (413 on its Content-Length) is matched here; one
        that matches no route is "unmatched", so scanners cannot add series."""
        template = getattr(scope.get("route"), "path_format", None)
        if template:
            return template
        if self._routes is None:
            self._routes = list(_templates(getattr(scope.get("app"), "routes", ())))
        return next((t for regex, t in self._routes if regex.match(scope["path"])), UNMATCHED_ROUTE)
