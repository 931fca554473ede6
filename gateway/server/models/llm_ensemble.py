"""An LLM reached through a text-in, text-out ensemble (tensorrtllm_backend's `ensemble`
contract: text_input, max_tokens, ... -> text_output): tokenizing and detokenizing happen
inside Triton. For repositories with no separately callable engine."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import Usage
from gateway.server.models.base import ModelAdapter, Piece, Resume, Run, check, tensor
from gateway.server.models.inputs import LlmInputs, LlmParameters


class LlmRequest:
    def __init__(self, inputs: LlmInputs, parameters: LlmParameters) -> None:
        self.inputs, self.parameters = inputs, parameters


class EnsembleRun(Run):
    decoupled = True

    def __init__(self, adapter: EnsembleLlmAdapter, prepared: LlmRequest, skip: int = 0) -> None:
        self.triton_model = adapter.triton_model
        self.prepared = prepared
        self.pieces: list[str] = []
        # Pieces an earlier run of this (deterministic) request already sent.
        self.skip = skip

    def inputs(self, stream: bool) -> list[InferInput]:
        inputs, parameters = self.prepared.inputs, self.prepared.parameters
        items = [
            tensor("text_input", np.array([[inputs.text_input.encode("utf-8")]], dtype=np.object_), "BYTES"),
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

    def outputs(self) -> list[InferRequestedOutput]:
        return [InferRequestedOutput("text_output")]

    def take(self, result: InferResult) -> list[Piece]:
        texts = result.as_numpy("text_output").reshape(-1)
        text = "".join(t.decode("utf-8", errors="replace") for t in texts)
        if not text:
            return []
        self.pieces.append(text)
        if len(self.pieces) <= self.skip:
            return []
        return [Piece(text)]

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        return {"text_output": "".join(self.pieces)}, None

    @property
    def produced(self) -> bool:
        return len(self.pieces) > self.skip


class EnsembleLlmAdapter(ModelAdapter):
    kind = "llm"
    decoupled = True

    def __init__(self, name: str, triton_model: str, *, stop_model: str | None = None) -> None:
        super().__init__(name, triton_model)
        self.stop_model = stop_model

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> LlmRequest:
        return LlmRequest(
            check(LlmInputs, inputs, self.name, "invalid_inputs"),
            check(LlmParameters, parameters, self.name, "invalid_inputs"),
        )

    def stored_inputs(self, prepared: LlmRequest) -> dict[str, Any]:
        return prepared.inputs.model_dump(exclude_defaults=True) | {"max_tokens": prepared.inputs.max_tokens}

    def new_run(self, prepared: LlmRequest, resume: Resume | None = None) -> Run:
        return EnsembleRun(self, prepared, skip=resume.pieces if resume else 0)

    def deterministic(self, prepared: LlmRequest) -> bool:
        p = prepared.parameters
        greedy = p.temperature == 0 or ((p.top_k or 0) <= 1 and not p.top_p)
        return greedy or p.seed is not None

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": "ensemble"}
