"""X-Request-ID: one id per HTTP call, from nginx or the client (when it is sane), else
made here. It is bound into the log context as `trace_id` for the whole call, returned in
the response's X-Request-ID header (on a /v1 answer, which names its durable request
there as OpenAI's API does, in X-Trace-ID instead), and stored with a submitted request (submit.py), so
the dispatcher and the binder log under it too (gateway.common.logs).

Each call ends with one access line (method, path, status, duration): the line that
carries both ids for a submit, since submit() binds the gateway's request id once it
has one. Probes and scrapes log theirs at DEBUG."""

from __future__ import annotations

import logging
import re
import time
import uuid
from contextvars import ContextVar

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.common.logs import bind_request_ids, clear_request_ids

log = logging.getLogger("gateway.access")

HEADER = "X-Request-ID"
TRACE_HEADER = "X-Trace-ID"  # where the call's id goes when X-Request-ID names the request
_HEADER_KEY = HEADER.lower().encode()
MAX_LENGTH = 128
# nginx's $request_id (32 hex), UUIDs, ULIDs, W3C trace ids, "abc-123": letters, digits and
# a few separators. Anything else (spaces, quotes, control characters, overlong) is
# replaced, so a client cannot forge or break log lines. nginx.conf applies the same rule.
VALID = re.compile(rf"[A-Za-z0-9._~:/+=@-]{{1,{MAX_LENGTH}}}")
QUIET_PATHS = frozenset({"/healthz", "/readyz", "/metrics"})

_current: ContextVar[str | None] = ContextVar("trace_id", default=None)


def current_trace_id() -> str | None:
    """The X-Request-ID of the HTTP call being handled (None outside one)."""
    return _current.get()


def new_trace_id() -> str:
    return uuid.uuid4().hex  # the same shape as nginx's $request_id


def accepted_trace_id(value: bytes | None) -> str:
    """The client's (or nginx's) id when it is sane, else a new one."""
    if value:
        try:
            text = value.decode("ascii")
        except UnicodeDecodeError:
            return new_trace_id()
        if VALID.fullmatch(text):
            return text
    return new_trace_id()


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = next((v for k, v in scope["headers"] if k == _HEADER_KEY), None)
        trace_id = accepted_trace_id(incoming)
        token = _current.set(trace_id)
        bind_request_ids(trace_id=trace_id)
        started = time.perf_counter()
        status = 500  # what the client gets if the app raises before answering

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                headers = MutableHeaders(scope=message)
                if HEADER in headers:  # a /v1 answer: x-request-id names the durable request, as OpenAI's does
                    headers[TRACE_HEADER] = trace_id
                else:
                    headers[HEADER] = trace_id
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            level = logging.DEBUG if scope["path"] in QUIET_PATHS else logging.INFO
            if log.isEnabledFor(level):
                elapsed_ms = (time.perf_counter() - started) * 1000
                log.log(level, "%s %s %d %.1fms", scope["method"], scope["path"], status, elapsed_ms)
            clear_request_ids()
            _current.reset(token)
