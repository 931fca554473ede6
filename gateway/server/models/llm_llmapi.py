"""An LLM served by TensorRT-LLM's llmapi model on Triton (the PyTorch backend,
triton_backend/all_models/llmapi/tensorrt_llm in NVIDIA/TensorRT-LLM, or the local stand-in
llm_llmapi): text in, text out; the backend tokenizes itself.

The gateway still tokenizes the prompt with the model's tokenizer (text_input, or chat
messages rendered with its chat template): to refuse a prompt over the context before
anything is queued (422 prompt_too_long), to route by the prompt's block keys, and to count
usage (prompt tokens from the prompt, completion tokens from the text that came back). It
sends the text as `text_input` with `sampling_param_*` inputs (max_tokens, stop strings,
temperature, top_k, top_p, seed, presence and frequency penalties), `streaming`, and asks
for finish_reason and stop_reason, and for the per-request perf metrics
(sampling_param_return_perf_metrics), whose kv_cache_reused_block x tokens_per_block is
usage.cached_tokens (the real model.py sends these metrics as strings).

The contract has no way to ask for per-token log probabilities (SamplingParams.logprobs is
not one of its inputs; cumulative_logprob comes back "None" without it), for guided
decoding, for bad words or for a repetition penalty: those are refused by name. Tools work
(the gateway renders them into the prompt); a forced tool call needs guided decoding and is
refused.

In streaming mode each response of the real model carries the text so far (the LLM API's
CompletionOutput.text); TEXT_SO_FAR says so, and the run turns it into exact deltas, so the
pieces, joined, equal the final text. A trailing U+FFFD (an unfinished character) is held
back until the end. Closing the gRPC stream cancels the generation (the model checks its
requests' cancellation every cancellation_check_period_ms). A stop string ends the text
before it: TensorRT-LLM leaves it out of the output. A run interrupted after sending text is
not continued from it (the backend takes text, not the tokens it made); a greedy or seeded
request runs again and skips the pieces already sent."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

import numpy as np
from tritonclient.grpc import InferInput, InferRequestedOutput, InferResult

from gateway.protocol import Usage
from gateway.server.models.base import InvalidInput, Piece, Resume, Run, check, tensor
from gateway.server.models.inputs import EngineParameters
from gateway.server.models.llm_engine import EngineInputs, EngineLlmAdapter, EngineRequest
from gateway.server.models.sampling import sampling_tensors

if TYPE_CHECKING:
    from gateway.server.models.spec import ModelSpec

# What a streamed text_output holds: True, the text so far (TensorRT-LLM's llmapi model.py
# sends CompletionOutput.text); False, only the text new since the previous response.
TEXT_SO_FAR = True
_UNFINISHED = "\ufffd"
# The sampling parameters the llmapi model takes (its helpers.py), as its inputs name them
# (models/sampling.py); a repetition penalty, which it cannot take, is refused by name.
LLMAPI_SAMPLING = {
    name: f"sampling_param_{name}"
    for name in ("temperature", "top_k", "top_p", "seed", "presence_penalty", "frequency_penalty")
}


@dataclass
class LlmapiRequest(EngineRequest):
    prompt_text: str = ""  # what is sent as text_input (the rendered chat, or the text)


def _strings(result: InferResult, name: str) -> list[str]:
    try:
        array = result.as_numpy(name)
    except Exception:  # an output this response does not carry
        return []
    if array is None:
        return []
    return [v.decode("utf-8", errors="replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]


def _vector(name: str, values: list[Any], dtype: Any, datatype: str) -> InferInput:
    """A 1-D tensor: the llmapi model has no batch dimension (max_batch_size 0)."""
    return tensor(name, np.array(values, dtype=dtype), datatype)


class LlmapiRun(Run):
    decoupled = True

    def __init__(self, adapter: LlmapiLlmAdapter, prepared: LlmapiRequest, skip: int = 0) -> None:
        self.triton_model = adapter.triton_model
        self.adapter = adapter
        self.prepared = prepared
        self.text_so_far = adapter.text_so_far
        self.received = ""  # the text the backend has sent, whole
        self.emitted = ""  # the part of it given out as pieces
        self.pieces = 0
        self.skip = skip  # pieces an earlier run of this request already sent
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.reused_blocks: int | None = None  # prompt blocks the backend served from its cache

    def inputs(self, stream: bool) -> list[InferInput]:
        p = self.prepared
        items = [
            _vector("text_input", [p.prompt_text.encode("utf-8")], np.object_, "BYTES"),
            _vector("streaming", [stream], np.bool_, "BOOL"),
            _vector("sampling_param_max_tokens", [p.max_tokens], np.int32, "INT32"),
            # The model's default (false) puts the prompt before the generated text.
            _vector("sampling_param_exclude_input_from_output", [True], np.bool_, "BOOL"),
            _vector("sampling_param_return_perf_metrics", [True], np.bool_, "BOOL"),
            _vector("return_finish_reason", [True], np.bool_, "BOOL"),
            _vector("return_stop_reason", [True], np.bool_, "BOOL"),
        ]
        if p.inputs.stop_words:
            words = [w.encode("utf-8") for w in p.inputs.stop_words]
            items.append(_vector("sampling_param_stop", words, np.object_, "BYTES"))
        return items + sampling_tensors(p.parameters, LLMAPI_SAMPLING, batched=False)

    def outputs(self) -> list[InferRequestedOutput]:
        names = ("text_output", "finish_reason", "stop_reason", "kv_cache_reused_block")
        return [InferRequestedOutput(name) for name in names]

    def take(self, result: InferResult) -> list[Piece]:
        for name in ("finish_reason", "stop_reason"):
            values = [v for v in _strings(result, name) if v and v != "None"]  # "None": str(None), not yet
            if values:
                setattr(self, name, values[0])
        reused = [v for v in _strings(result, "kv_cache_reused_block") if v.strip().isdigit()]
        if reused:
            self.reused_blocks = int(reused[0])
        texts = _strings(result, "text_output")
        if not texts:
            return []
        text = "".join(texts)
        self.received = text if self.text_so_far else self.received + text
        return self._advance(final=False)

    def flush(self) -> list[Piece]:
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> list[Piece]:
        """The text received beyond what was emitted, as a piece. Text sent is never taken
        back: a backend text that no longer begins with it (which TensorRT-LLM's streaming
        does not do) adds nothing more."""
        if not self.received.startswith(self.emitted):
            return []
        new = self.received[len(self.emitted) :]
        if not final:
            new = new.rstrip(_UNFINISHED)
        if not new:
            return []
        self.emitted += new
        self.pieces += 1
        return [Piece(new)] if self.pieces > self.skip else []

    def final(self) -> tuple[dict[str, Any], Usage | None]:
        p = self.prepared
        text = self.emitted
        completion = len(self.adapter.tokenizer.encode(text, add_special_tokens=False)) if text else 0
        reason = self.finish_reason or ("length" if completion >= p.max_tokens else "stop")
        outputs: dict[str, Any] = {"text_output": text, "finish_reason": reason}
        if self.stop_reason is not None:
            outputs["stop_reason"] = self.stop_reason
        return outputs, self.adapter.usage(p, completion, self.reused_blocks)

    @property
    def produced(self) -> bool:
        return self.pieces > self.skip


class LlmapiLlmAdapter(EngineLlmAdapter):
    """The engine adapter's admission, chat rendering and routing keys; a text contract."""

    resumable = False
    features: frozenset[str] = frozenset({"tools", "penalties", "prompt_cache_key"})

    def __init__(self, spec: ModelSpec, triton_model: str, *, tokenizer_dir: str, text_so_far: bool = TEXT_SO_FAR):
        super().__init__(spec, triton_model, tokenizer_dir=tokenizer_dir)
        self.text_so_far = text_so_far

    def validate(self, inputs: dict[str, Any], parameters: dict[str, Any]) -> LlmapiRequest:
        prepared = check(EngineInputs, inputs, self.name, "invalid_inputs")
        sampling = check(EngineParameters, parameters, self.name, "invalid_inputs")
        # What the llmapi model's inputs cannot ask for.
        refused = {
            "bad_words": bool(prepared.bad_words),
            "guided_decoding": prepared.guided_decoding is not None,
            "repetition_penalty": sampling.repetition_penalty is not None,
            "logprobs": sampling.logprobs,
        }
        for name, used in refused.items():
            if used:
                raise InvalidInput(
                    "invalid_inputs",
                    f"{self.name}: {name} is not supported by the llmapi contract",
                    details={"param": name},
                )
        return self.prepare(prepared, sampling)

    def prepare(self, inputs: EngineInputs, parameters: EngineParameters) -> LlmapiRequest:
        text = self.render(inputs)
        # The engine adapter's checks, on the text as it will be sent (already rendered).
        rendered = EngineInputs.model_construct(text_input=text, max_tokens=inputs.max_tokens)
        request = super().prepare(rendered, parameters)
        values = {f.name: getattr(request, f.name) for f in fields(request)}
        values["inputs"] = inputs
        values["stop_ids"] = self.tokenizer.encode_words(inputs.stop_words)
        return LlmapiRequest(**values, prompt_text=text)

    def new_run(self, prepared: EngineRequest, resume: Resume | None = None) -> Run:
        assert isinstance(prepared, LlmapiRequest)
        return LlmapiRun(self, prepared, skip=resume.pieces if resume else 0)

    def deterministic(self, prepared: EngineRequest) -> bool:
        return not prepared.parameters.unseeded

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "mode": "llmapi"}
