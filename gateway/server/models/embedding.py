"""Embedding models: one text or image in, one L2-normalised vector out (not decoupled)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import IndexRef, Usage
from gateway.server.llm.tokenizer import token_ids
from gateway.server.models.base import BatchRow, ModelAdapter, Resume, Run, bytes_tensor, check
from gateway.server.models.inputs import ImageInputs, NoParameters, TextInputs


def _load_tokenizer(directory: str | None) -> Tokenizer | None:
    path = Path(directory) / "tokenizer.json" if directory else None
    if path is None or not path.exists():
        return None
    return Tokenizer.from_file(str(path))


class EmbeddingRun(Run):
    def __init__(self, adapter: EmbeddingAdapter, prepared: TextInputs | ImageInputs) -> None:
        self.triton_model = adapter.triton_model
        self.adapter = adapter
        self.prepared = prepared
        self.vector: list[float] | None = None

    def inputs(self, stream: bool) -> list[InferInput]:
        if isinstance(self.prepared, ImageInputs):
            return [bytes_tensor(self.adapter.input_name, self.prepared.data)]
        return [bytes_tensor(self.adapter.input_name, self.prepared.text.encode("utf-8"))]

    def outputs(self) -> list[InferRequestedOutput]:
        return [InferRequestedOutput(self.adapter.output_name)]

    def batch_row(self) -> BatchRow:
        value = self.prepared.data if isinstance(self.prepared, ImageInputs) else self.prepared.text.encode("utf-8")
        return BatchRow(self.adapter.input_name, value, self.adapter.output_name)

    def take(self, result: InferResult) -> list:
        self.vector = result.as_numpy(self.adapter.output_name).reshape(-1).astype(float).tolist()
        return []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        """The vector; the usage (the text's tokens) was counted once at submission and
        comes from the request (Runner.partial)."""
        outputs = {self.adapter.output_name: self.vector} if self.vector is not None else {}
        return outputs, None


class EmbeddingAdapter(ModelAdapter):
    kind = "embedding"

    def __init__(
        self,
        name: str,
        triton_model: str,
        *,
        input_kind: str,
        output_name: str,
        space: str | None,
        dimensions: int | None = None,
        tokenizer_dir: str | None = None,
    ) -> None:
        super().__init__(name, triton_model)
        # The model's tokenizer, where one is configured, only to count usage.
        self.tokenizer = _load_tokenizer(tokenizer_dir)
        self.input_kind = input_kind  # "text" or "image"
        self.input_name = "image" if input_kind == "image" else "text"
        self.output_name = output_name
        self.space = space
        self.dimensions = dimensions
        self.index = IndexRef(space=space, output=output_name) if space else None
        self._inputs = ImageInputs if input_kind == "image" else TextInputs

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> TextInputs | ImageInputs:
        prepared = check(self._inputs, inputs, self.name, "invalid_inputs")
        check(NoParameters, parameters, self.name, "invalid_inputs")
        return prepared

    def stored_inputs(self, prepared: TextInputs | ImageInputs) -> dict[str, Any]:
        if isinstance(prepared, ImageInputs):
            return {"image": {"sha256": hashlib.sha256(prepared.data).hexdigest(), "bytes": len(prepared.data)}}
        return prepared.model_dump()

    def new_run(self, prepared: TextInputs | ImageInputs, resume: Resume | None = None) -> Run:
        return EmbeddingRun(self, prepared)

    def prompt_tokens(self, prepared: TextInputs | ImageInputs) -> int | None:
        return self.count_tokens(prepared)

    def count_tokens(self, prepared: TextInputs | ImageInputs) -> int | None:
        if self.tokenizer is None or not isinstance(prepared, TextInputs):
            return None
        return len(token_ids(self.tokenizer, prepared.text))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "input": self.input_kind, "space": self.space, "dimensions": self.dimensions}
