"""The result record: one per request. The dispatcher publishes it when the request
ends, the binder stores it in MongoDB (and its embedding in the vector index), and
GET /results/<id> returns it."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.protocol.states import State

DEFAULT_TENANT = "default"
# MongoDB's collection of tenants' settings (weight, limits, webhook secrets): the gateway
# writes it, the binder reads the webhook secrets from it.
TENANTS_COLLECTION = "tenants"


class ErrorInfo(BaseModel):
    code: str
    message: str


class Timings(BaseModel):
    queue_ms: float | None = None
    run_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None


class Usage(BaseModel):
    """Token counts of an LLM request (the gateway's own tokenizer counts them)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    # Prompt tokens the engine served from its prefix KV cache (whole blocks it reused), as
    # the engine reports it (TensorRT-LLM: kv_cache_reused_blocks x tokens per block); None
    # where the engine reported nothing.
    cached_tokens: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def replica_name(url: str) -> str:
    """How records name a replica: a stable opaque name, never its address (records are
    the tenants' to read; operators map names to addresses with GET /admin/replicas)."""
    return "replica-" + hashlib.sha256(url.encode()).hexdigest()[:12]


class Route(BaseModel):
    """Why the request went to the replica it ran on."""

    replica: str  # replica_name()
    policy: str  # cache_aware, load, least_outstanding, round_robin
    reason: str  # prefix, load, imbalance, only_replica, ...
    matched_blocks: int = 0
    prompt_blocks: int = 0
    load: float = 0.0


class IndexRef(BaseModel):
    """Where a result's embedding goes: the vector-index space, and the output that
    holds the vector. Set by the dispatcher from the model registry, so the binder
    needs no knowledge of models."""

    space: str
    output: str


WebhookEvent = Literal["completed", "failed", "canceled", "expired"]
WEBHOOK_EVENTS: list[WebhookEvent] = ["completed", "failed", "canceled", "expired"]


class WebhookSpec(BaseModel):
    """Where to POST the request's terminal event (signed per Standard Webhooks)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    url: str = Field(max_length=2048, examples=["https://example.com/hooks/triton"])
    events: list[WebhookEvent] = Field(
        default_factory=lambda: list(WEBHOOK_EVENTS),
        max_length=4,
        description="Which terminal events to deliver (default: whichever one happens)",
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if any(ord(c) < 33 or ord(c) == 127 for c in value):
            raise ValueError("webhook url must not contain spaces or control characters")
        try:
            parts = urlsplit(value)
            port = parts.port  # raises on a port that is not a number in range
        except ValueError as exc:
            raise ValueError(f"webhook url is not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("webhook url must be an http(s) URL with a host")
        del port
        return value


class ResultRecord(BaseModel):
    request_id: str
    model: str
    status: State
    tenant: str = DEFAULT_TENANT
    inputs: dict[str, Any] = Field(default_factory=dict)
    parameters: dict[str, Any] = Field(default_factory=dict)
    outputs: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    replica: str | None = None  # replica_name() of the replica that ran it
    route: Route | None = None
    usage: Usage | None = None
    attempts: int = 0
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None
    timings: Timings = Field(default_factory=Timings)
    webhook: WebhookSpec | None = None
    index: IndexRef | None = None
    # Free-form labels given at submission (OpenAI metadata, batch and line ids).
    metadata: dict[str, str] = Field(default_factory=dict)
    # The X-Request-ID of the HTTP call that submitted it: the binder logs under it and
    # sends it to webhook receivers. Optional, so records without it still read.
    trace_id: str | None = None
    # The W3C traceparent of its submission, when traced: the binder's span joins that
    # trace (gateway.common.tracing). Optional, as trace_id.
    traceparent: str | None = None
    # Set by the binder.
    stored: bool = False
    expires_at: datetime | None = None
    webhook_status: str | None = None
    webhook_attempts: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def embedding(self) -> tuple[str, list[float]] | None:
        """(space, vector) when this result holds an embedding for the index."""
        if self.status != State.SUCCEEDED or not self.outputs or self.index is None:
            return None
        vector = self.outputs.get(self.index.output)
        return (self.index.space, vector) if vector else None


def utc(timestamp: float | None) -> datetime | None:
    return None if timestamp is None else datetime.fromtimestamp(timestamp, tz=UTC)
