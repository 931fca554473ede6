"""Structured logs: structlog renders both structlog and standard-library records, as
JSON lines (LOG_FORMAT=json) or readable key=value lines (console).

Tracebacks are plain text, never with local variables (they would carry request
bodies). A request id bound with `bind_request_id` (from nginx's X-Request-ID, or made
here) is on every line logged while that request is handled, in any process it
reaches."""

from __future__ import annotations

import logging
import sys

import structlog
from structlog.types import Processor


def bind_request_id(request_id: str) -> None:
    structlog.contextvars.bind_contextvars(request_id=request_id)


def clear_request_id() -> None:
    structlog.contextvars.unbind_contextvars("request_id")


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
