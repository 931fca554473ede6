"""An LLM called directly on its engine (TensorRT-LLM's `tensorrt_llm` contract, or the
local stand-in llm_engine): the gateway owns the tokens.

The prompt (text, or chat messages rendered with the model's chat template) is
tokenized here, checked against the engine's input limit before anything is queued
(422 prompt_too_long), and sent as input_ids; stop and bad words go as TensorRT-LLM word
lists. Responses carry output_ids, detokenized incrementally so that streamed pieces,
joined, equal the final text. Every record carries usage (prompt and completion
tokens). Cancelling the gRPC stream cancels the generation (the engine checks every
cancellation_check_period_ms). A run interrupted after sending tokens is resumed by
a new run that continues from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field, StringConstraints, model_validator
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import Usage
from gateway.server.llm.detokenizer import Detokenizer
from gateway.server.llm.tokenizer import ChatTemplateError, LlmTokenizer, word_list
from gateway.server.models.base import InvalidInput, ModelAdapter, Piece, Resume, Run, check, tensor
from gateway.server.models.inputs import MAX_TEXT_CHARS, LlmParameters, Strict, Word
from gateway.server.routing.blocks import block_keys

if TYPE_CHECKING:
    from gateway.server.models.registry import ModelSpec

Content = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content


class EngineInputs(Strict):
    text_input: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=256)
    max_tokens: int = Field(default=64, ge=1, le=32768)
    stop_words: list[Word] = Field(default_factory=list, max_length=16)
    bad_words: list[Word] = Field(default_factory=list, max_length=64)

    @model_validator(mode="after")
    def _one_prompt(self) -> EngineInputs:
        if (self.text_input is None) == (self.messages is None):
            raise ValueError("give exactly one of text_input or messages")
        return self


@dataclass
class EngineRequest:
    inputs: EngineInputs
    parameters: LlmParameters
    prompt_ids: list[int]
    max_tokens: int
    stop_ids: list[list[int]]
    bad_ids: list[list[int]]
    keys: list[bytes] = field(default_factory=list)  # the prompt's block hash chain, for routing


class EngineRun(Run):
    decoupled = True

    def __init__(self, adapter: EngineLlmAdapter, prepared: EngineRequest, resume: Resume | None) -> None:
        self.triton_model = adapter.triton_model
        self.adapter = adapter
        self.prepared = prepared
        self.generated: list[int] = []
        self.detok = Detokenizer(adapter.tokenizer.tokenizer)
        self.pending: list[int] = []  # generated ids whose text is not complete yet
        self.sent = 0
        if resume is not None and resume.token_ids:
            self.generated = list(resume.token_ids)
            self.detok.prime(self.generated)

    def inputs(self, stream: bool) -> list[InferInput]:
        p = self.prepared
        ids = np.array([p.prompt_ids + self.generated], dtype=np.int32)
        remaining = max(1, p.max_tokens - len(self.generated))
        items = [
            tensor("input_ids", ids, "INT32"),
            tensor("input_lengths", np.array([[ids.shape[1]]], dtype=np.int32), "INT32"),
            tensor("request_output_len", np.array([[remaining]], dtype=np.int32), "INT32"),
            tensor("end_id", np.array([[self.adapter.tokenizer.end_id]], dtype=np.int32), "INT32"),
            tensor("pad_id", np.array([[self.adapter.tokenizer.pad_id]], dtype=np.int32), "INT32"),
            tensor("streaming", np.array([[stream]], dtype=np.bool_), "BOOL"),
            tensor("exclude_input_in_output", np.array([[True]], dtype=np.bool_), "BOOL"),
        ]
        for name, words in (("stop_words_list", p.stop_ids), ("bad_words_list", p.bad_ids)):
            array = word_list(words)
            if array is not None:
                items.append(tensor(name, array, "INT32"))
        s = p.parameters
        scalars = (
            ("temperature", s.temperature, np.float32, "FP32"),
            ("runtime_top_k", s.top_k, np.int32, "INT32"),
            ("runtime_top_p", s.top_p, np.float32, "FP32"),
            ("repetition_penalty", s.repetition_penalty, np.float32, "FP32"),
            ("seed", s.seed, np.uint64, "UINT64"),
        )
        for name, value, dtype, datatype in scalars:
            if value is not None:
                items.append(tensor(name, np.array([[value]], dtype=dtype), datatype))
        return items

    def outputs(self) -> list[InferRequestedOutput]:
        return [InferRequestedOutput("output_ids"), InferRequestedOutput("sequence_length")]

    def take(self, result: InferResult) -> list[Piece]:
        ids = result.as_numpy("output_ids")
        lengths = result.as_numpy("sequence_length")
        if ids is None:
            return []
        count = int(lengths.reshape(-1)[0]) if lengths is not None else ids.reshape(-1).shape[0]
        pieces = []
        for token in ids.reshape(-1)[:count].tolist():
            self.generated.append(int(token))
            self.pending.append(int(token))
            text = self.detok.step(int(token))
            if text:
                pieces.append(Piece(text, tuple(self.pending)))
                self.pending = []
        self.sent += len(pieces)
        return pieces

    def flush(self) -> list[Piece]:
        rest = self.detok.finish()
        if not rest and not self.pending:
            return []
        piece, self.pending = Piece(rest, tuple(self.pending)), []
        return [piece] if rest else []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        p = self.prepared
        stopped_by_word = any(w and self.generated[-len(w) :] == w for w in p.stop_ids)
        length = len(self.generated) >= p.max_tokens and not stopped_by_word
        outputs = {"text_output": self.detok.text, "finish_reason": "length" if length else "stop"}
        return outputs, Usage(prompt_tokens=len(p.prompt_ids), completion_tokens=len(self.generated))

    @property
    def produced(self) -> bool:
        return bool(self.generated)

    def carry_from(self, previous: Run) -> None:
        if isinstance(previous, EngineRun):
            self.generated, self.detok, self.pending = previous.generated, previous.detok, previous.pending


class EngineLlmAdapter(ModelAdapter):
    kind = "llm"
    decoupled = True
    resumable = True

    def __init__(self, spec: ModelSpec, triton_model: str, *, tokenizer_dir: str) -> None:
        super().__init__(spec.name, triton_model)
        self.spec = spec
        self.tokenizer = LlmTokenizer(tokenizer_dir)
        self.tokens_per_block = spec.tokens_per_block
        self.context_length = spec.context_length or self.tokenizer.context_length
        self.max_input_tokens = spec.max_input_tokens or self.context_length - 1

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> EngineRequest:
        prepared = check(EngineInputs, inputs, self.name, "invalid_inputs")
        sampling = check(LlmParameters, parameters, self.name, "invalid_inputs")
        return self.prepare(prepared, sampling)

    def prepare(self, inputs: EngineInputs, parameters: LlmParameters) -> EngineRequest:
        if inputs.messages is not None:
            try:
                text = self.tokenizer.render_chat([m.model_dump() for m in inputs.messages])
            except ChatTemplateError as exc:
                raise InvalidInput("invalid_inputs", f"{self.name}: {exc}") from None
        else:
            text = inputs.text_input or ""
        ids = self.tokenizer.encode(text)
        if not ids:
            raise InvalidInput("invalid_inputs", f"{self.name}: the prompt is empty after tokenization")
        room = self.context_length - len(ids)
        if len(ids) > self.max_input_tokens or room < 1:
            raise InvalidInput(
                "prompt_too_long",
                f"{self.name}: the prompt is {len(ids)} tokens; this model takes at most {self.max_input_tokens}",
                details={"prompt_tokens": len(ids), "max_input_tokens": self.max_input_tokens},
            )
        max_tokens = min(inputs.max_tokens, self.spec.max_output_tokens, room)
        return EngineRequest(
            inputs=inputs,
            parameters=parameters,
            prompt_ids=ids,
            max_tokens=max_tokens,
            stop_ids=self.tokenizer.encode_words(inputs.stop_words),
            bad_ids=self.tokenizer.encode_words(inputs.bad_words),
            keys=block_keys(ids, self.tokens_per_block),
        )

    def stored_inputs(self, prepared: EngineRequest) -> dict[str, Any]:
        return prepared.inputs.model_dump(exclude_none=True, exclude_defaults=True) | {
            "max_tokens": prepared.inputs.max_tokens
        }

    def new_run(self, prepared: EngineRequest, resume: Resume | None = None) -> Run:
        return EngineRun(self, prepared, resume)

    def prompt_tokens(self, prepared: EngineRequest) -> int | None:
        return len(prepared.prompt_ids)

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "mode": "engine",
            "max_input_tokens": self.max_input_tokens,
            "context_length": self.context_length,
            "chat_template": self.tokenizer.chat_template is not None,
        }
