"""One adapter per Triton model the gateway serves: how a request's `inputs` and
`parameters` are validated, turned into Triton tensors, and how Triton's responses
become the result's `outputs`."""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

MAX_TEXT_CHARS = 100_000
# What image files begin with: PNG, JPEG, GIF, WebP (RIFF), BMP.
_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF", b"BM")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LlmInputs(Strict):
    text_input: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["Hello, my name is"])
    max_tokens: int = Field(default=64, ge=1, le=4096)
    stop_words: list[str] = Field(default_factory=list, max_length=16)
    bad_words: list[str] = Field(default_factory=list, max_length=64)


class LlmParameters(Strict):
    temperature: float | None = Field(default=None, ge=0, le=10)
    top_k: int | None = Field(default=None, ge=0, le=1000)
    top_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)


class TextInputs(Strict):
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["a cat sits on the mat"])


class ImageInputs(Strict):
    image: str = Field(description="PNG or JPEG file, base64-encoded", examples=["iVBORw0KGgo..."])
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


def tensor(name: str, value: np.ndarray, datatype: str) -> InferInput:
    item = InferInput(name, list(value.shape), datatype)
    item.set_data_from_numpy(value)
    return item


def _text_tensor(name: str, text: str) -> InferInput:
    return tensor(name, np.array([[text.encode("utf-8")]], dtype=np.object_), "BYTES")


@dataclass(frozen=True)
class ModelAdapter:
    """Base: a model with one input and one embedding output (non-decoupled)."""

    name: str
    inputs_model: type[Strict]
    output_name: str
    parameters_model: type[Strict] = NoParameters
    # A decoupled model answers through gRPC stream_infer, one or more responses.
    decoupled: bool = False
    # A model on this Triton that ends a running request by its id (see llm_generator).
    stop_model: str | None = None
    kind: ClassVar[str] = "embedding"

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> tuple[Strict, Strict]:
        return self.inputs_model.model_validate(inputs), self.parameters_model.model_validate(parameters)

    def triton_inputs(self, inputs: Any, parameters: Any, stream: bool) -> list[InferInput]:
        if isinstance(inputs, ImageInputs):
            return [tensor("image", np.array([[inputs.data]], dtype=np.object_), "BYTES")]
        field = next(iter(self.inputs_model.model_fields))
        return [_text_tensor(field, getattr(inputs, field))]

    def requested_outputs(self) -> list[InferRequestedOutput]:
        return [InferRequestedOutput(self.output_name)]

    def parse(self, result: InferResult) -> dict[str, Any]:
        return {self.output_name: result.as_numpy(self.output_name).reshape(-1).astype(float).tolist()}

    def merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return parts[-1] if parts else {}

    def describe_inputs(self, inputs: Any) -> dict[str, Any]:
        """The inputs as stored with the result (images by digest, not bytes)."""
        if isinstance(inputs, ImageInputs):
            return {"image": {"sha256": hashlib.sha256(inputs.data).hexdigest(), "bytes": len(inputs.data)}}
        return inputs.model_dump()


@dataclass(frozen=True)
class LlmAdapter(ModelAdapter):
    kind: ClassVar[str] = "text-generation"

    def triton_inputs(self, inputs: Any, parameters: Any, stream: bool) -> list[InferInput]:
        items = [
            _text_tensor("text_input", inputs.text_input),
            tensor("max_tokens", np.array([[inputs.max_tokens]], dtype=np.int32), "INT32"),
            tensor("stream", np.array([[stream]], dtype=np.bool_), "BOOL"),
        ]
        for name, words in (("stop_words", inputs.stop_words), ("bad_words", inputs.bad_words)):
            if words:
                items.append(tensor(name, np.array([[w.encode("utf-8") for w in words]], dtype=np.object_), "BYTES"))
        scalars = (
            ("temperature", parameters.temperature, np.float32, "FP32"),
            ("top_k", parameters.top_k, np.int32, "INT32"),
            ("top_p", parameters.top_p, np.float32, "FP32"),
            ("repetition_penalty", parameters.repetition_penalty, np.float32, "FP32"),
            ("random_seed", parameters.seed, np.uint64, "UINT64"),
        )
        for name, value, dtype, datatype in scalars:
            if value is not None:
                items.append(tensor(name, np.array([[value]], dtype=dtype), datatype))
        return items

    def parse(self, result: InferResult) -> dict[str, Any]:
        texts = result.as_numpy("text_output").reshape(-1)
        return {"text_output": "".join(t.decode("utf-8", errors="replace") for t in texts)}

    def merge(self, parts: list[dict[str, Any]]) -> dict[str, Any]:
        return {"text_output": "".join(part["text_output"] for part in parts)}


ADAPTERS: dict[str, ModelAdapter] = {
    adapter.name: adapter
    for adapter in (
        LlmAdapter(
            name="llm", inputs_model=LlmInputs, parameters_model=LlmParameters, output_name="text_output",
            decoupled=True, stop_model="llm_generator",
        ),
        ModelAdapter(name="clip_image", inputs_model=ImageInputs, output_name="image_embeds"),
        ModelAdapter(name="clip_text", inputs_model=TextInputs, output_name="text_embeds"),
        ModelAdapter(name="text_embed", inputs_model=TextInputs, output_name="embedding"),
    )
}
