"""Request and response bodies of the HTTP API (the OpenAPI at /docs comes from here)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from gateway.contracts import ResultRecord, State, WebhookSpec


class InferRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "model": "llm",
                    "inputs": {"text_input": "The best thing about Triton is", "max_tokens": 32},
                    "parameters": {"temperature": 0.8, "top_p": 0.95, "seed": 7},
                    "stream": True,
                },
                {"model": "text_embed", "inputs": {"text": "a cat sits on the mat"}},
                {"model": "clip_image", "inputs": {"image": "<base64 PNG or JPEG>"},
                 "webhook": {"url": "https://example.com/hooks/triton"}},
            ]
        },
    )

    model: str = Field(description="llm, clip_image, clip_text or text_embed")
    inputs: dict[str, Any] = Field(description="Model inputs; see each model's schema in the README")
    parameters: dict[str, Any] = Field(default_factory=dict, description="llm: temperature, top_k, top_p, seed, repetition_penalty")
    stream: bool = Field(default=False, description="llm: emit a `token` event per piece of text")
    webhook: WebhookSpec | None = None
    timeout_s: float | None = Field(default=None, gt=0, description="Deadline from acceptance; the request expires after it")
    priority: int = Field(default=0, ge=-10, le=10, description=">0 runs before 0, <0 after")


class ResultUrls(BaseModel):
    result: str
    events: str
    cancel: str


class Accepted(BaseModel):
    request_id: str
    status: State
    urls: ResultUrls


class LiveStatus(BaseModel):
    """A request that has not ended yet."""

    request_id: str
    model: str
    status: State
    created_at: Any
    started_at: Any = None
    attempts: int = 0
    urls: ResultUrls


class CancelResponse(BaseModel):
    request_id: str
    status: State
    message: str


class SearchRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"text": "a kitten on a rug", "k": 5}, {"image": "<base64>", "space": "clip"}]},
    )

    text: str | None = Field(default=None, min_length=1, max_length=10_000)
    image: str | None = Field(default=None, description="base64 PNG or JPEG (clip space)")
    space: str | None = Field(default=None, description="minilm (text_embed) or clip; default: minilm for text, clip for images")
    k: int = Field(default=5, ge=1, le=100)


class SearchHit(BaseModel):
    request_id: str
    score: float
    record: ResultRecord | None


class SearchResponse(BaseModel):
    space: str
    hits: list[SearchHit]


__all__ = [
    "Accepted", "CancelResponse", "InferRequest", "LiveStatus", "ResultUrls", "SearchHit", "SearchRequest",
    "SearchResponse", "WebhookSpec",
]
