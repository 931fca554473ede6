"""Structured logs: structlog renders both structlog and standard-library records, as
JSON lines (LOG_FORMAT=json) or readable key=value lines (console).

Tracebacks are plain text, never with local variables (they would carry request
bodies).

Two ids are bound into the log context (`bind_request_ids`), with the same field names in
every process:
- `trace_id`: the X-Request-ID of the HTTP call (nginx's, the client's, or one the gateway
  made). It travels with the request (in its queue payload and its result record), so it
  is on the lines of nginx, the gateway's HTTP layer and dispatcher, and the binder's
  archiver and webhook sender, and goes to webhook receivers as X-Request-ID.
- `request_id`: the gateway's own request id, the one its API returns and MongoDB keys.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import structlog
from structlog.types import Processor

TRACE_ID = "trace_id"
REQUEST_ID = "request_id"


def bind_request_ids(*, trace_id: str | None, request_id: str | None = None) -> None:
    """Bind both ids into the log context of the running task. An id given as None is
    unbound: a task started from another request's context (which it copies) must not
    log under that request's ids."""
    ids = {TRACE_ID: trace_id, REQUEST_ID: request_id}
    structlog.contextvars.bind_contextvars(**{k: v for k, v in ids.items() if v is not None})
    structlog.contextvars.unbind_contextvars(*(k for k, v in ids.items() if v is None))


def clear_request_ids() -> None:
    structlog.contextvars.unbind_contextvars(TRACE_ID, REQUEST_ID)


@contextmanager
def request_ids_bound(*, trace_id: str | None, request_id: str | None = None) -> Iterator[None]:
    """bind_request_ids for the lines logged inside the block (a loop's work on one
    request); the ids bound before it are back afterwards."""
    before = {k: v for k, v in structlog.contextvars.get_contextvars().items() if k in (TRACE_ID, REQUEST_ID)}
    bind_request_ids(trace_id=trace_id, request_id=request_id)
    try:
        yield
    finally:
        clear_request_ids()
        structlog.contextvars.bind_contextvars(**before)


def configure_logging(level: str = "INFO", fmt: str = "console") -> None:
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
        shared.append(structlog.processors.format_exc_info)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=False, exception_formatter=structlog.dev.plain_traceback)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # httpx logs every request line at INFO; keep it for debugging only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
    # PyMongo's DEBUG command log holds the documents (requests' inputs and outputs).
    logging.getLogger("pymongo").setLevel(max(logging.INFO, root.level))
