"""What the gateway and the binder agree on: Redis key and stream names, request states,
event kinds, the result record, request ids and embedding spaces. Defined once here;
both sides import it."""

from __future__ import annotations

import os
import re
import time
from datetime import datetime, timezone
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import urlsplit

from bson.binary import Binary, BinaryVectorDtype
from pydantic import BaseModel, ConfigDict, Field, field_validator

VECTOR_SUBTYPE = 9

# -- Redis names -----------------------------------------------------------------------

# Request lanes by priority, read in this order by the dispatchers' consumer group.
REQUEST_LANES = ("requests:high", "requests", "requests:low")
DISPATCH_GROUP = "dispatchers"
RESULTS_STREAM = "results"
BINDER_GROUP = "binders"
DEAD_LETTER_STREAM = "results:dead"
DEADLINES_KEY = "deadlines"  # sorted set: request id scored by its deadline
BACKLOG_KEY = "backlog"  # count of accepted requests not yet started
DONE_CHANNEL = "done"  # pub/sub: a request reached a terminal state
CANCEL_CHANNEL = "cancel"  # pub/sub: cancel a running request
WEBHOOK_DUE_KEY = "webhooks:due"  # sorted set: delivery id scored by next attempt time


def request_key(request_id: str) -> str:
    return f"req:{request_id}"


def events_key(request_id: str) -> str:
    return f"events:{request_id}"


def idempotency_key(key: str) -> str:
    return f"idem:{key}"


def webhook_key(delivery_id: str) -> str:
    return f"webhook:{delivery_id}"


def lane_for(priority: int) -> str:
    return REQUEST_LANES[0] if priority > 0 else REQUEST_LANES[2] if priority < 0 else REQUEST_LANES[1]


# -- States and events -----------------------------------------------------------------


class State(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({State.SUCCEEDED, State.FAILED, State.CANCELED, State.EXPIRED})


class EventKind(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    TOKEN = "token"  # a streamed piece of text (llm)
    OUTPUT = "output"  # a whole output (embedding models)
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELED = "canceled"
    EXPIRED = "expired"


TERMINAL_EVENT = {
    State.SUCCEEDED: EventKind.COMPLETED,
    State.FAILED: EventKind.FAILED,
    State.CANCELED: EventKind.CANCELED,
    State.EXPIRED: EventKind.EXPIRED,
}

# -- Embedding spaces --------------------------------------------------------------------

# Which model's output goes into which vector index, and under which output name.
EMBEDDING_OUTPUTS = {
    "clip_image": ("clip", "image_embeds"),
    "clip_text": ("clip", "text_embeds"),
    "text_embed": ("minilm", "embedding"),
}
# To search a space by text, embed the query with this model.
SPACE_TEXT_MODEL = {"clip": "clip_text", "minilm": "text_embed"}
SPACE_IMAGE_MODEL = {"clip": "clip_image"}

# -- Request ids -------------------------------------------------------------------------

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
REQUEST_ID_PATTERN = re.compile(r"^[0-9A-HJKMNP-TV-Z]{36}$")


def new_request_id(now: float | None = None) -> str:
    """48 bits of milliseconds, then 128 random bits, in Crockford base32 (36 characters):
    unguessable, URL-safe, and sorted by creation time."""
    millis = int((time.time() if now is None else now) * 1000)
    value = (millis << 128) | int.from_bytes(os.urandom(16), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(175, -5, -5))


def request_id_time(request_id: str) -> float | None:
    """When the id was made (seconds since the epoch), or None if it is not one of ours."""
    if not REQUEST_ID_PATTERN.match(request_id):
        return None
    value = 0
    for char in request_id:
        value = (value << 5) | _CROCKFORD.index(char)
    return (value >> 128) / 1000


# -- The result record -------------------------------------------------------------------


class ErrorInfo(BaseModel):
    code: str
    message: str


class Timings(BaseModel):
    queue_ms: float | None = None
    run_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None


WebhookEvent = Literal["completed", "failed", "canceled", "expired"]


class WebhookSpec(BaseModel):
    """Where to POST the request's terminal event (signed per Standard Webhooks)."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2048, examples=["https://example.com/hooks/triton"])
    events: list[WebhookEvent] = Field(
        default_factory=lambda: ["completed", "failed", "canceled", "expired"],
        description="Which terminal events to deliver (default: whichever one happens)",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("webhook url must be an http(s) URL with a host")
        return value


class ResultRecord(BaseModel):
    """One per request: what the dispatcher publishes when it ends, what the binder
    stores in MongoDB, and what GET /results/<id> returns."""

    request_id: str
    model: str
    status: State
    inputs: dict[str, Any] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(default_factory=dict)
    outputs: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    replica: str | None = None
    attempts: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: Timings = Field(default_factory=Timings)
    webhook: WebhookSpec | None = None
    # Set by the binder.
    stored: bool = False
    expires_at: datetime | None = None
    webhook_status: str | None = None
    webhook_attempts: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def embedding(self) -> tuple[str, list[float]] | None:
        """(space, vector) when this result holds an embedding for the index."""
        if self.status != State.SUCCEEDED or not self.outputs or self.model not in EMBEDDING_OUTPUTS:
            return None
        space, output = EMBEDDING_OUTPUTS[self.model]
        vector = self.outputs.get(output)
        return (space, vector) if vector else None


def utc(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=timezone.utc)


# -- MongoDB -----------------------------------------------------------------------------

RESULTS_COLLECTION = "results"


def _pack_vector(vector: list[float]) -> Binary:
    # BSON vector (binary subtype 9, float32): a quarter of the size of an array of
    # doubles, and far cheaper to write.
    return Binary.from_vector([float(x) for x in vector], BinaryVectorDtype.FLOAT32)


def _unpack_vector(value: Any) -> list[float]:
    if isinstance(value, list):
        return value
    # Servers that do not keep the subtype hand back plain bytes.
    if not (isinstance(value, Binary) and value.subtype == VECTOR_SUBTYPE):
        value = Binary(bytes(value), VECTOR_SUBTYPE)
    return [float(x) for x in value.as_vector().data]


def _map_embedding(model: str, outputs: dict[str, Any] | None, convert: Any) -> dict[str, Any] | None:
    if not outputs or model not in EMBEDDING_OUTPUTS:
        return outputs
    name = EMBEDDING_OUTPUTS[model][1]
    return {**outputs, name: convert(outputs[name])} if outputs.get(name) is not None else outputs


def record_to_document(record: ResultRecord) -> dict[str, Any]:
    """One document per request, keyed by request_id (the unique _id); embeddings as
    BSON float32 vectors."""
    # Fields at their defaults are left out (smaller documents, cheaper writes); the
    # record model puts them back on reading.
    document = {"_id": record.request_id, **record.model_dump(mode="python", exclude_defaults=True)}
    if record.outputs is not None:
        document["outputs"] = _map_embedding(record.model, record.outputs, _pack_vector)
    return document


def record_from_document(document: dict[str, Any]) -> ResultRecord:
    fields = {k: v for k, v in document.items() if k != "_id"}
    fields["outputs"] = _map_embedding(fields.get("model", ""), fields.get("outputs"), _unpack_vector)
    return ResultRecord.model_validate(fields)


def embedding_from_document(document: dict[str, Any]) -> tuple[str, list[float]] | None:
    """(space, vector) of a stored document that holds an embedding."""
    model = document.get("model", "")
    if model not in EMBEDDING_OUTPUTS or not document.get("outputs"):
        return None
    space, name = EMBEDDING_OUTPUTS[model]
    value = document["outputs"].get(name)
    return (space, _unpack_vector(value)) if value is not None else None
