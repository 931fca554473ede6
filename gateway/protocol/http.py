"""Bodies of the native HTTP API, shared by the server (validation, OpenAPI) and the
client SDK (parsing answers), so the two cannot drift apart."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from gateway.protocol.records import ResultRecord, WebhookSpec
from gateway.protocol.states import State

MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]
# 16 of the caller's (OpenAI's limit) and room for the labels the /v1 layer adds to them
# (api, user, safety_identifier, service_tier, background, ...).
Metadata = Annotated[dict[MetadataKey, MetadataValue], Field(max_length=24)]


class InferRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,  # no coercion: "stream": "yes" or "timeout_s": "8" is refused
        json_schema_extra={
            "examples": [
                {
                    "model": "llm",
                    "inputs": {"text_input": "The best thing about Triton is", "max_tokens": 32},
                    "parameters": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
                    "stream": True,
                },
                {"model": "text_embed", "inputs": {"text": "a cat sits on the mat"}},
                # Many inputs, one request: the record holds their vectors packed (protocol/vectors.py).
                {"model": "text_embed", "inputs": {"text": ["a cat sits on the mat", "a dog in the park"]}},
                {
                    "model": "clip_image",
                    "inputs": {"image": "<base64 PNG or JPEG>"},
                    "webhook": {"url": "https://example.com/hooks/triton"},
                },
            ]
        },
    )

    model: str = Field(max_length=128, description="A model of the registry (GET /models)")
    inputs: dict[str, Any] = Field(max_length=16, description="Model inputs; see each model's schema in the README")
    parameters: dict[str, Any] = Field(
        default_factory=dict, max_length=16, description="llm: temperature, top_k, top_p, seed, repetition_penalty"
    )
    stream: bool = Field(default=False, description="llm: emit `token` events as text is generated")
    webhook: WebhookSpec | None = None
    timeout_s: float | None = Field(default=None, gt=0, description="Deadline from acceptance; expires after it")
    priority: int = Field(default=0, ge=-10, le=10, description=">0 runs before 0, <0 after")
    metadata: Metadata = Field(default_factory=dict, description="Labels kept with the result")


class ResultUrls(BaseModel):
    result: str
    events: str
    cancel: str


class Accepted(BaseModel):
    request_id: str
    status: State
    urls: ResultUrls


class QueuePosition(BaseModel):
    """Where a queued request stands (an estimate: the queue is fair between tenants, not
    first come first served)."""

    position: int = Field(description="Requests of its model expected to start before it")
    tenant_position: int = Field(description="Requests of its tenant (same model and band) before it")
    eta_s: float | None = Field(default=None, description="When it should start, from the recent start rate")


class LiveStatus(BaseModel):
    """A request that has not ended yet."""

    request_id: str
    model: str
    status: State
    created_at: datetime
    started_at: datetime | None = None
    attempts: int = 0
    replica: str | None = None
    # The labels given at submission (as the record will carry them).
    metadata: dict[str, str] = Field(default_factory=dict)
    queue: QueuePosition | None = None  # while queued
    urls: ResultUrls


class CancelResponse(BaseModel):
    request_id: str
    status: State
    message: str


class SearchRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"examples": [{"text": "a kitten on a rug", "k": 5}, {"image": "<base64>", "space": "clip"}]},
    )

    text: str | None = Field(default=None, min_length=1, max_length=10_000)
    image: str | None = Field(default=None, max_length=12_000_000, description="base64 PNG or JPEG (clip space)")
    space: str | None = Field(
        default=None,
        max_length=64,
        description="minilm (text_embed) or clip; default: minilm for text, clip for images",
    )
    k: int = Field(default=5, ge=1, le=100)


class SearchHit(BaseModel):
    request_id: str
    # The input's index in its call, for a vector of a many-input request (None: the
    # request's one vector).
    row: int | None = None
    score: float
    record: ResultRecord | None


class SearchResponse(BaseModel):
    space: str
    hits: list[SearchHit]


def result_urls(request_id: str) -> ResultUrls:
    return ResultUrls(
        result=f"/results/{request_id}",
        events=f"/results/{request_id}/events",
        cancel=f"/results/{request_id}/cancel",
    )
