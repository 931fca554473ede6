"""An LLM called directly on its engine (TensorRT-LLM's `tensorrt_llm` contract, or the
local stand-in llm_engine): the gateway owns the tokens.

The prompt (text, or chat messages rendered with the model's chat template) is
tokenized here, checked against the engine's input limit before anything is queued
(422 prompt_too_long), and sent as input_ids; bad words go as TensorRT-LLM word lists. Stop
sequences are matched here on the detokenized text (gateway.server.llm.stops: left out of
the text, held back while they may begin, the engine's stream closed when one is found);
only those whose token ids decode to exactly their text also go to the engine. Responses
carry output_ids, detokenized incrementally so that streamed pieces, joined, equal the final
text. Every record carries usage (prompt and completion
tokens). Cancelling the gRPC stream cancels the generation (the engine checks every
cancellation_check_period_ms). A run interrupted after sending tokens is resumed by
a new run that continues from them; with guided decoding the new run generates them again
from the prompt and checks them (the engine's grammar must see them: a fresh grammar after
them would start a second document), failing `resume_diverged` if the engine differs.

What else of TensorRT-LLM's engine contract it uses:
- logprobs: return_log_probs, read from output_log_probs (each new token's log-probability);
  top_logprobs > 0 also asks for return_generation_logits and takes the most likely
  alternatives at each position from generation_logits (the raw logits; the engine must be
  built to gather them). outputs.logprobs holds, per generated token, OpenAI's
  {token, logprob, bytes, top_logprobs}.
- guided decoding: guided_decoding_guide_type / guided_decoding_guide (json, json_schema,
  regex, ebnf_grammar; the engine needs a guided-decoding backend).
- prefix-cache hits: return_perf_metrics on every request; kv_cache_reused_blocks x
  tokens_per_block becomes usage.cached_tokens.
- presence_penalty and frequency_penalty.
Tools (OpenAI function definitions) are rendered into the prompt by the chat template
(gateway.server.llm.tools); the calls are read from the text by the OpenAI layer."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import Field, StringConstraints, model_validator
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import Usage
from gateway.protocol.storable import StorableDict
from gateway.server.llm.blocks import block_keys, salt_id
from gateway.server.llm.detokenizer import Detokenizer
from gateway.server.llm.stops import StopMatcher
from gateway.server.llm.tokenizer import _BYTE_LEVEL as BYTE_LEVEL
from gateway.server.llm.tokenizer import ChatTemplateError, LlmTokenizer, word_list
from gateway.server.models.base import (
    InvalidInput,
    ModelAdapter,
    Piece,
    Resume,
    Run,
    RunError,
    bytes_tensor,
    check,
    requested_outputs,
    scalar_tensor,
    tensor,
)
from gateway.server.models.inputs import MAX_TEXT_CHARS, EngineParameters, Strict, Word
from gateway.server.models.sampling import sampling_tensors

if TYPE_CHECKING:
    from gateway.server.models.spec import ModelSpec

Content = Annotated[str, StringConstraints(max_length=MAX_TEXT_CHARS)]
# What a record's log-probabilities may take at most, as MongoDB stores them: its document
# limit (16 MiB) less what a request's body may bring (MAX_BODY_BYTES, 8 MiB by default)
# and room for the rest of the record. A request that could make more is refused.
LOGPROBS_BUDGET_BYTES = 7 * 1024 * 1024
# The sampling parameters the engine takes, as its inputs name them (models/sampling.py).
ENGINE_SAMPLING = {
    "temperature": "temperature",
    "top_k": "runtime_top_k",
    "top_p": "runtime_top_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "seed": "seed",
}


def logprobs_bound(positions: int, top: int, token_bytes: int) -> int:
    """The most bytes (BSON) the log-probabilities of `positions` tokens with `top`
    alternatives each can take, for tokens of at most `token_bytes` bytes: an entry's token
    text (at most 3 bytes a byte: U+FFFD for a byte that is part of a character), its bytes
    as an array (at most 9 bytes a byte), its number, keys and headers (50), and each
    position's own array and key (26)."""
    return positions * ((top + 1) * (50 + 12 * token_bytes) + 26)


Name = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]


class CalledFunction(Strict):
    name: Name
    arguments: Content  # JSON text


class ToolCall(Strict):
    """A call an assistant message made (to render an earlier turn)."""

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=128)  # assistant
    tool_call_id: str | None = Field(default=None, max_length=256)  # tool


class FunctionDefinition(Strict):
    name: Name
    description: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)
    parameters: StorableDict | None = None  # a JSON schema of the arguments (stored with the record)
    strict: bool | None = None


class ToolDefinition(Strict):
    """A tool the chat template offers the model (OpenAI's function tool)."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class GuidedDecoding(Strict):
    """TensorRT-LLM's guided decoding: the output follows this grammar."""

    guide_type: Literal["json", "json_schema", "regex", "ebnf_grammar"]
    guide: str | None = Field(default=None, max_length=MAX_TEXT_CHARS)


class EngineInputs(Strict):
    text_input: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT_CHARS)
    messages: list[ChatMessage] | None = Field(default=None, min_length=1, max_length=256)
    max_tokens: int = Field(default=64, ge=1, le=32768)
    stop_words: list[Word] = Field(default_factory=list, max_length=16)
    bad_words: list[Word] = Field(default_factory=list, max_length=64)
    tools: list[ToolDefinition] | None = Field(default=None, max_length=128)
    guided_decoding: GuidedDecoding | None = None

    @model_validator(mode="after")
    def _one_prompt(self) -> EngineInputs:
        if (self.text_input is None) == (self.messages is None):
            raise ValueError("give exactly one of text_input or messages")
        if self.tools and self.messages is None:
            raise ValueError("tools are for messages (the chat template renders them)")
        return self


@dataclass
class EngineRequest:
    inputs: EngineInputs
    parameters: EngineParameters
    prompt_ids: list[int]
    max_tokens: int
    stop_ids: list[list[int]]
    bad_ids: list[list[int]]
    # The stop sequences the engine can stop on itself: those whose token ids stand for
    # exactly their text (the gateway matches every one on the text in any case).
    engine_stop_ids: list[list[int]] = field(default_factory=list)
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
        self.logprobs: list[dict[str, Any]] = []  # OpenAI's entries, for the tokens this process saw
        self.reused_blocks: int | None = None  # prompt blocks the engine served from its cache
        # Stop sequences, matched on the text (what the engine is sent is only an exact subset).
        self.stops = StopMatcher(prepared.inputs.stop_words)
        self.text = ""  # the text given out: up to the stop sequence, if one came
        # A guided run that resumes generates the tokens already sent again and checks them
        # (replay), so that the engine's grammar has seen them: a grammar started afresh
        # after them would begin a second document. Others continue from them directly.
        self.replay: list[int] = []
        self.replayed = 0
        if resume is not None and resume.token_ids:
            self.generated = list(resume.token_ids)
            self.detok.prime(self.generated)
            self.text = self.detok.text
            self._replay_if_guided()

    def _replay_if_guided(self) -> None:
        if self.prepared.inputs.guided_decoding is not None and self.generated:
            self.replay, self.replayed = list(self.generated), 0
            self.logprobs = []  # (they come again with the replayed tokens)

    @property
    def done(self) -> bool:
        """A stop sequence ended the text: the engine's stream can be closed."""
        return self.stops.stopped

    def inputs(self, stream: bool) -> list[InferInput]:
        p = self.prepared
        continued = [] if self.replay else self.generated
        ids = np.array([p.prompt_ids + continued], dtype=np.int32)
        remaining = max(1, p.max_tokens - len(continued))
        tokenizer = self.adapter.tokenizer
        items = [
            tensor("input_ids", ids, "INT32"),
            scalar_tensor("input_lengths", ids.shape[1], np.int32, "INT32"),
            scalar_tensor("request_output_len", remaining, np.int32, "INT32"),
            scalar_tensor("end_id", tokenizer.end_id, np.int32, "INT32"),
            scalar_tensor("pad_id", tokenizer.pad_id, np.int32, "INT32"),
            scalar_tensor("streaming", stream, np.bool_, "BOOL"),
            scalar_tensor("exclude_input_in_output", True, np.bool_, "BOOL"),
        ]
        for name, words in (("stop_words_list", p.engine_stop_ids), ("bad_words_list", p.bad_ids)):
            array = word_list(words)
            if array is not None:
                items.append(tensor(name, array, "INT32"))
        s = p.parameters
        items += sampling_tensors(s, ENGINE_SAMPLING, shared=True)
        if s.cache_salt and self.adapter.spec.cache_salt:
            items.append(scalar_tensor("cache_salt_id", salt_id(s.cache_salt), np.uint64, "UINT64"))
        flags = (
            ("return_log_probs", s.logprobs),
            ("return_generation_logits", s.top_logprobs > 0),
            ("return_perf_metrics", True),
        )
        for name, value in flags:
            if value:
                items.append(scalar_tensor(name, True, np.bool_, "BOOL"))
        guided = p.inputs.guided_decoding
        if guided is not None:
            items.append(bytes_tensor("guided_decoding_guide_type", guided.guide_type.encode()))
            if guided.guide is not None:
                items.append(bytes_tensor("guided_decoding_guide", guided.guide.encode("utf-8")))
        return items

    def outputs(self) -> list[InferRequestedOutput]:
        names = ["output_ids", "sequence_length", "kv_cache_reused_blocks"]
        if self.prepared.parameters.logprobs:
            names.append("output_log_probs")
        if self.prepared.parameters.top_logprobs:
            names.append("generation_logits")
        return requested_outputs(tuple(names))

    def take(self, result: InferResult) -> list[Piece]:
        ids = result.as_numpy("output_ids")
        lengths = result.as_numpy("sequence_length")
        reused = _optional(result, "kv_cache_reused_blocks")
        if reused is not None and reused.size:
            self.reused_blocks = int(reused.reshape(-1)[0])
        if ids is None:
            return []
        count = int(lengths.reshape(-1)[0]) if lengths is not None else ids.reshape(-1).shape[0]
        tokens = [int(t) for t in ids.reshape(-1)[:count].tolist()]
        if self.prepared.parameters.logprobs:
            self._take_logprobs(result, tokens)
        pieces = []
        for token in tokens:
            if self.replayed < len(self.replay):
                if int(token) != self.replay[self.replayed]:
                    raise RunError(
                        "resume_diverged",
                        f"the resumed run generated other tokens than the {len(self.replay)} already sent "
                        "(the engine is not deterministic for this request); submit it again",
                    )
                self.replayed += 1
                continue
            if self.stops.stopped:
                break  # (tokens the engine made past a stop sequence are not the answer's)
            self.generated.append(int(token))
            self.pending.append(int(token))
            text = self.stops.feed(self.detok.step(int(token)))
            if text:
                pieces.append(Piece(text, tuple(self.pending)))
                self.text += text
                self.pending = []
        self.sent += len(pieces)
        return pieces

    def _take_logprobs(self, result: InferResult, tokens: list[int]) -> None:
        """OpenAI's logprobs entries for these tokens: each one's log-probability (the
        engine's output_log_probs) and, if asked, the most likely alternatives (from the raw
        generation logits)."""
        values = _optional(result, "output_log_probs")
        chosen = values.reshape(-1)[: len(tokens)].tolist() if values is not None else []
        top = self.prepared.parameters.top_logprobs
        logits = _optional(result, "generation_logits") if top else None
        rows = logits.reshape(len(tokens), -1) if logits is not None and tokens and logits.size else None
        tokenizer = self.adapter.tokenizer
        for position, token in enumerate(tokens):
            entry = _entry(tokenizer, token, chosen[position] if position < len(chosen) else None)
            if rows is not None:
                row = rows[position].astype(np.float64)
                logprobs = row - row.max() - np.log(np.exp(row - row.max()).sum())
                best = np.argpartition(-logprobs, min(top, len(row) - 1))[:top]
                best = best[np.argsort(-logprobs[best])]
                entry["top_logprobs"] = [_alternative(tokenizer, int(t), float(logprobs[t])) for t in best]
                if entry["logprob"] is None:
                    entry["logprob"] = float(logprobs[token])
            self.logprobs.append(entry)  # (logprob None: the engine sent none for it)

    def flush(self) -> list[Piece]:
        if self.stops.stopped:
            return []
        rest = self.stops.feed(self.detok.finish())
        rest += self.stops.finish()
        if not rest and not self.pending:
            return []
        piece, self.pending = Piece(rest, tuple(self.pending)), []
        self.text += rest
        return [piece] if rest else []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        p = self.prepared
        length = len(self.generated) >= p.max_tokens and not self.stops.stopped
        outputs: dict[str, Any] = {"text_output": self.text, "finish_reason": "length" if length else "stop"}
        if self.stops.matched is not None:  # which one (Anthropic's stop_sequence says)
            outputs["stop_sequence"] = self.stops.matched
        if p.parameters.logprobs:
            outputs["logprobs"] = self.logprobs[: len(self.generated)]
        return outputs, self.adapter.usage(p, len(self.generated), self.reused_blocks)

    @property
    def produced(self) -> bool:
        return bool(self.generated)

    def carry_from(self, previous: Run) -> None:
        if isinstance(previous, EngineRun):
            self.generated, self.detok, self.pending = previous.generated, previous.detok, previous.pending
            self.logprobs, self.stops, self.text = previous.logprobs, previous.stops, previous.text
            self._replay_if_guided()


def _optional(result: InferResult, name: str) -> np.ndarray | None:
    """An output this response may not carry."""
    try:
        return result.as_numpy(name)
    except Exception:
        return None


def _alternative(tokenizer: LlmTokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    """One of the most likely tokens at a position (OpenAI's TopLogprob: no alternatives of its own)."""
    data = tokenizer.token_bytes(token)
    return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(data)}


def _entry(tokenizer: LlmTokenizer, token: int, logprob: float | None) -> dict[str, Any]:
    """The chosen token at a position, with its alternatives (filled in when asked for)."""
    return {**_alternative(tokenizer, token, logprob), "top_logprobs": []}


class EngineLlmAdapter(ModelAdapter):
    kind = "llm"
    decoupled = True
    resumable = True
    salted_cache = True
    # What the contract can do beyond text (the OpenAI layer refuses the rest by name).
    features: frozenset[str] = frozenset(
        {"logprobs", "top_logprobs", "guided_decoding", "tools", "penalties", "repetition_penalty", "prompt_cache_key"}
    )

    def __init__(self, spec: ModelSpec, triton_model: str, *, tokenizer_dir: str) -> None:
        super().__init__(spec.name, triton_model)
        self.spec = spec
        self.tokenizer = LlmTokenizer(tokenizer_dir)
        self.tokens_per_block = spec.tokens_per_block
        self.context_length = spec.context_length or self.tokenizer.context_length
        self.max_input_tokens = spec.max_input_tokens or self.context_length - 1

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> EngineRequest:
        prepared = check(EngineInputs, inputs, self.name, "invalid_inputs")
        sampling = check(EngineParameters, parameters, self.name, "invalid_inputs")
        return self.prepare(prepared, sampling)

    def render(self, inputs: EngineInputs) -> str:
        """The prompt text: text_input, or the messages (and tools) through the chat template."""
        if inputs.messages is None:
            return inputs.text_input or ""
        tools = [t.model_dump(exclude_none=True) for t in inputs.tools] if inputs.tools else None
        try:
            return self.tokenizer.render_chat([m.model_dump(exclude_none=True) for m in inputs.messages], tools=tools)
        except ChatTemplateError as exc:
            raise InvalidInput("invalid_inputs", f"{self.name}: {exc}") from None

    def usage(self, prepared: EngineRequest, completion: int, reused_blocks: int | None) -> Usage:
        """The request's tokens. The engine's count of reused prompt blocks is kept only from
        an engine that salts its cache per tenant (spec.cache_salt): an unsalted engine reuses
        any tenant's blocks, and its count would tell one tenant what another sent (the
        OpenAI layer then estimates from the gateway's salted index)."""
        prompt = len(prepared.prompt_ids)
        if not self.spec.cache_salt:
            reused_blocks = None
        cached = None if reused_blocks is None else min(prompt, reused_blocks * self.tokens_per_block)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)

    def prepare(self, inputs: EngineInputs, parameters: EngineParameters) -> EngineRequest:
        text = self.render(inputs)
        floor = self.tokenizer.fewest_tokens(text)
        if floor > self.max_input_tokens:  # refused unread: tokenizing 8 MB costs seconds
            raise InvalidInput(
                "prompt_too_long",
                f"{self.name}: the prompt is at least {floor} tokens; this model takes at most {self.max_input_tokens}",
                details={"prompt_tokens": floor, "max_input_tokens": self.max_input_tokens},
            )
        ids = self.tokenizer.encode_prompt(text, chat=inputs.messages is not None)
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
        if parameters.logprobs:
            self._check_logprobs_fit(max_tokens, parameters.top_logprobs)
        return EngineRequest(
            inputs=inputs,
            parameters=parameters,
            prompt_ids=ids,
            max_tokens=max_tokens,
            stop_ids=self.tokenizer.encode_words(inputs.stop_words),
            engine_stop_ids=self.tokenizer.exact_words(inputs.stop_words),
            bad_ids=self.tokenizer.encode_words(inputs.bad_words),
            keys=block_keys(ids, self.tokens_per_block, parameters.cache_salt),
        )

    @functools.cached_property
    def longest_token_bytes(self) -> int:
        """An upper bound on the bytes of any token: a byte-level piece has a character a
        byte; any other at most its piece's UTF-8 length (a SentencePiece one has its text,
        or <0xAB> for one byte)."""
        tokenizer = self.tokenizer.tokenizer
        decoder = json.loads(tokenizer.decoder.__getstate__()).get("type") if tokenizer.decoder else None
        byte_level = decoder == "ByteLevel"
        return max(
            (
                len(piece) if byte_level and all(c in BYTE_LEVEL for c in piece) else len(piece.encode())
                for piece in tokenizer.get_vocab()
            ),
            default=1,
        )

    def _check_logprobs_fit(self, max_tokens: int, top: int) -> None:
        """422 logprobs_too_large where the log-probabilities could make the record more
        than storage holds (LOGPROBS_BUDGET_BYTES), saying how many tokens fit."""
        if logprobs_bound(max_tokens, top, self.longest_token_bytes) <= LOGPROBS_BUDGET_BYTES:
            return
        most = LOGPROBS_BUDGET_BYTES // logprobs_bound(1, top, self.longest_token_bytes)
        raise InvalidInput(
            "logprobs_too_large",
            f"{self.name}: the log-probabilities of {max_tokens} tokens with {top} alternatives each could be "
            f"more than a result can store; at most {most} tokens at top_logprobs {top} (lower max_tokens "
            "or top_logprobs)",
            details={"max_tokens": most, "top_logprobs": top},
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
