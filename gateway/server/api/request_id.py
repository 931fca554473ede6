"""X-Request-ID: one id per HTTP call, from nginx or the client (when it is sane), else
made here. The edge middleware (gateway.server.api.edge) binds it into the log context as
`trace_id` for the whole call and returns it in the response's X-Request-ID header (on a
/v1 answer, which names its durable request there as OpenAI's API does, in X-Trace-ID
instead); a submitted request stores it (gateway.server.submission), so the dispatcher
and the binder log under it too (gateway.common.logs)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from contextvars import ContextVar

HEADER = "X-Request-ID"
TRACE_HEADER = "X-Trace-ID"  # where the call's id goes when X-Request-ID names the request
MAX_LENGTH = 128
# nginx's $request_id (32 hex), UUIDs, ULIDs, W3C trace ids, "abc-123": letters, digits and
# a few separators. Anything else (spaces, quotes, control characters, overlong) is
# replaced, so a client cannot forge or break log lines. nginx.conf applies the same rule.
VALID = re.compile(rf"[A-Za-z0-9._~:/+=@-]{{1,{MAX_LENGTH}}}")

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


def bind_trace_id(trace_id: str) -> Callable[[], None]:
    """Make trace_id the current call's id; returns what restores the previous one."""
    token = _current.set(trace_id)
    return lambda: _current.reset(token)
