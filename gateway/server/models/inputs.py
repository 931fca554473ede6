"""Request inputs and parameters per model kind, validated before anything is queued.
Every string and list has a limit."""

from __future__ import annotations

import base64
import binascii
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, model_validator

MAX_TEXT_CHARS = 100_000
MAX_IMAGE_BASE64 = 11 * 1024 * 1024
# A stop or bad word: short text, as TensorRT-LLM's word lists expect.
Word = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# What image files begin with: PNG, JPEG, GIF, WebP (RIFF), BMP.
_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF", b"BM")


class Strict(BaseModel):
    """Model inputs: unknown fields refused, and no coercion (a "8" is not a number, a
    true is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LlmInputs(Strict):
    text_input: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["Hello, my name is"])
    max_tokens: int = Field(default=64, ge=1, le=4096)
    stop_words: list[Word] = Field(default_factory=list, max_length=16)
    bad_words: list[Word] = Field(default_factory=list, max_length=64)


class LlmParameters(Strict):
    temperature: float | None = Field(default=None, ge=0, le=10)
    top_k: int | None = Field(default=None, ge=0, le=1000)
    top_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM's rule (both contracts): temperature 0, or no top_k above 1 and no
        top_p, is greedy search; anything else samples."""
        return self.temperature == 0 or ((self.top_k or 0) <= 1 and not self.top_p)

    @property
    def unseeded(self) -> bool:
        """Samples without a seed: the engines' default seed would draw the same every time."""
        return self.seed is None and not self.greedy


class EngineParameters(LlmParameters):
    """The parameters of an LLM on its engine or the llmapi contract (the ensemble takes only
    LlmParameters: what it cannot pass on is refused, never dropped)."""

    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # The log-probability of each generated token (outputs.logprobs), with this many of the
    # most likely alternatives at each position (engine contract only).
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    # Requests with the same key prefer the same replica (routing affinity, per model).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    # The prefix cache's salt: set by the gateway to the tenant (a caller's own is refused),
    # so that no tenant can learn from cache hits what another tenant sent.
    cache_salt: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> EngineParameters:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TextInputs(Strict):
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["a cat sits on the mat"])


class ImageInputs(Strict):
    image: str = Field(max_length=MAX_IMAGE_BASE64, description="PNG or JPEG file, base64-encoded")
    _data: bytes = PrivateAttr(default=b"")

    @model_validator(mode="after")
    def _decode(self) -> ImageInputs:
        self._data = decode_image(self.image)  # once: the tensor and the digest reuse it
        return self

    @property
    def data(self) -> bytes:
        return self._data


class NoParameters(Strict):
    pass


def decode_image(value: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image is not valid base64") from None
    if not data.startswith(_IMAGE_SIGNATURES):
        raise ValueError("image is not a PNG, JPEG, GIF, WebP or BMP file")
    return data
