"""An LLM reached through a text-in, text-out ensemble (tensorrtllm_backend's `ensemble`
contract: text_input, max_tokens, ... -> text_output): tokenizing and detokenizing happen
inside Triton. For repositories with no separately callable engine."""

from __future__ import annotations

from typing import Any

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import Usage
from gateway.server.llm.stops import StopMatcher
from gateway.server.llm.tokenizer import LlmTokenizer
from gateway.server.models.base import ModelAdapter, Piece, Resume, Run, check, tensor
from gateway.server.models.inputs import LlmInputs, LlmParameters
from gateway.server.models.sampling import sampling_tensors

# The sampling parameters the ensemble takes, as its inputs name them (models/sampling.py).
ENSEMBLE_SAMPLING = {
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "repetition_penalty": "repetition_penalty",
    "seed": "random_seed",
}


class LlmRequest:
    def __init__(self, inputs: LlmInputs, parameters: LlmParameters, prompt_tokens: int | None = None) -> None:
        self.inputs, self.parameters = inputs, parameters
        self.prompt_tokens = prompt_tokens  # by the model's tokenizer, where the gateway has it


class EnsembleRun(Run):
    decoupled = True

    def __init__(self, adapter: EnsembleLlmAdapter, prepared: LlmRequest, skip: int = 0) -> None:
        self.triton_model = adapter.triton_model
        self.adapter = adapter
        self.prepared = prepared
        # Stop sequences on the text, as on the engine path: the ensemble's own stop words
        # are token ids (they may miss a sequence and leave a found one in the text).
        self.stops = StopMatcher(prepared.inputs.stop_words)
        self.text = ""  # the text given out (up to a stop sequence)
        self.given = 0  # pieces given out, those an earlier run sent included
        # Pieces an earlier run of this (deterministic) request already sent.
        self.skip = skip
        # The engine's token counts (return_num_input_tokens / return_num_output_tokens).
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None

    def inputs(self, stream: bool) -> list[InferInput]:
        inputs, parameters = self.prepared.inputs, self.prepared.parameters
        items = [
            tensor("text_input", np.array([[inputs.text_input.encode("utf-8")]], dtype=np.object_), "BYTES"),
            tensor("max_tokens", np.array([[inputs.max_tokens]], dtype=np.int32), "INT32"),
            tensor("stream", np.array([[stream]], dtype=np.bool_), "BOOL"),
        ]
        if self.adapter.token_counts:
            for name in ("return_num_input_tokens", "return_num_output_tokens"):
                items.append(tensor(name, np.array([[True]], dtype=np.bool_), "BOOL"))
        for name, words in (("stop_words", inputs.stop_words), ("bad_words", inputs.bad_words)):
            if words:
                items.append(tensor(name, np.array([[w.encode("utf-8") for w in words]], dtype=np.object_), "BYTES"))
        return items + sampling_tensors(parameters, ENSEMBLE_SAMPLING)

    def outputs(self) -> list[InferRequestedOutput]:
        names = ["text_output"]
        if self.adapter.token_counts:
            names += ["num_input_tokens", "num_output_tokens"]
        return [InferRequestedOutput(name) for name in names]

    def _counts(self, result: InferResult) -> None:
        """The engine counts each response's new tokens (all of them when not streaming)."""
        found = {}
        for name in ("num_input_tokens", "num_output_tokens"):
            try:
                array = result.as_numpy(name)
            except Exception:  # an output this response does not carry
                array = None
            if array is not None and array.size:
                found[name] = int(array.reshape(-1)[0])
        if "num_input_tokens" in found:
            self.input_tokens = found["num_input_tokens"]
        if "num_output_tokens" in found:
            self.output_tokens = (self.output_tokens or 0) + found["num_output_tokens"]

    def take(self, result: InferResult) -> list[Piece]:
        if self.adapter.token_counts:
            self._counts(result)
        found = result.as_numpy("text_output")
        if found is None:
            return []
        texts = found.reshape(-1)
        return self._give(self.stops.feed("".join(t.decode("utf-8", errors="replace") for t in texts)))

    def flush(self) -> list[Piece]:
        return self._give(self.stops.finish())

    def _give(self, text: str) -> list[Piece]:
        if not text:
            return []
        self.text += text
        self.given += 1
        return [Piece(text)] if self.given > self.skip else []

    @property
    def done(self) -> bool:
        return self.stops.stopped

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        """The text, and from the engine's token counts usage and why it ended (all its
        tokens used: length)."""
        text = self.text
        if self.output_tokens is None:
            return {"text_output": text, "finish_reason": "stop"} if self.stops.stopped else {"text_output": text}, None
        length = self.output_tokens >= self.prepared.inputs.max_tokens and not self.stops.stopped
        prompt = self.input_tokens if self.input_tokens is not None else self.prepared.prompt_tokens
        usage = Usage(prompt_tokens=prompt or 0, completion_tokens=self.output_tokens)
        return {"text_output": text, "finish_reason": "length" if length else "stop"}, usage

    @property
    def produced(self) -> bool:
        return self.given > self.skip


class EnsembleLlmAdapter(ModelAdapter):
    kind = "llm"
    decoupled = True

    def __init__(
        self,
        name: str,
        triton_model: str,
        *,
        stop_model: str | None = None,
        tokenizer_dir: str | None = None,
        token_counts: bool = True,
    ) -> None:
        super().__init__(name, triton_model)
        self.stop_model = stop_model
        # Ask the ensemble for TensorRT-LLM's num_input_tokens / num_output_tokens (usage,
        # finish_reason length); an ensemble without those inputs is told by its spec.
        self.token_counts = token_counts
        # The tokenizer of the ensemble's preprocessing, if the gateway has it: it counts
        # prompt tokens (tokens per minute, usage) and completion tokens.
        self.tokenizer = LlmTokenizer(tokenizer_dir) if tokenizer_dir else None

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> LlmRequest:
        checked = check(LlmInputs, inputs, self.name, "invalid_inputs")
        prompt = len(self.tokenizer.encode(checked.text_input)) if self.tokenizer is not None else None
        return LlmRequest(checked, check(LlmParameters, parameters, self.name, "invalid_inputs"), prompt)

    def prompt_tokens(self, prepared: LlmRequest) -> int | None:
        return prepared.prompt_tokens

    def stored_inputs(self, prepared: LlmRequest) -> dict[str, Any]:
        return prepared.inputs.model_dump(exclude_defaults=True) | {"max_tokens": prepared.inputs.max_tokens}

    def new_run(self, prepared: LlmRequest, resume: Resume | None = None) -> Run:
        return EnsembleRun(self, prepared, skip=resume.pieces if resume else 0)

    def deterministic(self, prepared: LlmRequest) -> bool:
        return not prepared.parameters.unseeded

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": "ensemble"}
