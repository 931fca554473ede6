"""The wire contract shared by the gateway, the binder and the client: request ids,
states and event kinds, the result record, and the Redis names both server roles use.

Pure data (pydantic only): no FastAPI, no Redis client, no PyMongo, so the client SDK
can import it without the server's dependencies."""

from gateway.protocol.ids import new_request_id, request_id_time, valid_request_id
from gateway.protocol.records import (
    ErrorInfo,
    IndexRef,
    ResultRecord,
    Route,
    Timings,
    Usage,
    WebhookEvent,
    WebhookSpec,
    utc,
)
from gateway.protocol.states import TERMINAL_EVENT, TERMINAL_STATES, EventKind, State

__all__ = [
    "TERMINAL_EVENT",
    "TERMINAL_STATES",
    "ErrorInfo",
    "EventKind",
    "IndexRef",
    "ResultRecord",
    "Route",
    "State",
    "Timings",
    "Usage",
    "WebhookEvent",
    "WebhookSpec",
    "new_request_id",
    "request_id_time",
    "utc",
    "valid_request_id",
]
