"""llm_llmapi: a CPU or CUDA stand-in for TensorRT-LLM's llmapi model (the PyTorch backend on
Triton, triton_backend/all_models/llmapi/tensorrt_llm/1/model.py in NVIDIA/TensorRT-LLM), with
its inputs and outputs (config.pbtxt) and its behaviour, generating on the local engine
(llm_engine/1/engine.py: in-flight batching, prefix KV cache).

As the real model does:
- text_input holds one prompt (1-D); it is tokenized here with the model's own tokenizer
  (tokenizer.json in model_dir), and the output detokenized here, special tokens skipped.
- sampling_param_* are TensorRT-LLM's SamplingParams: max_tokens (default 32), temperature,
  top_k, top_p, seed, stop (strings, matched as their token ids) and exclude_input_from_output
  (default false: the text then begins with the prompt's).
- streaming=true: a response per generated token, each text_output holding the text so far
  (the LLM API's CompletionOutput.text, not the new piece), the last with the final flag;
  streaming=false: one response.
- return_finish_reason / return_stop_reason / return_cumulative_logprob add those outputs to
  every response, as strings: finish_reason "None" until the last response, then "stop" (end
  id or a stop string), "length" or "cancelled"; stop_reason the stop string that ended it,
  else "None"; cumulative_logprob "None" (the real model's inputs cannot ask the LLM API for
  log probabilities, SamplingParams.logprobs, so it has none to send and sends "None").
- A stop string's tokens are left out of the text (include_stop_str_in_output is false);
  when streaming only those of the last response, since text already sent is not taken back.
- A cancelled request (the client closed its stream) ends at the engine's next step with the
  error "Request cancelled by client" (CANCELLED). A `stop` request with the same request id
  ends it too, and is itself answered with that CANCELLED error first: a streaming request's
  last response says finish_reason "cancelled"; one that was not streaming gets no text (the
  real model sends it none) but that CANCELLED error, so it ends (on a model that is not
  decoupled, the stream RPC returns responses in request order: its client sees the
  cancellation first, as TensorRT-LLM's llmapi_client.py expects).
- Errors are sent as a final response with text_output "N/A" and "Error generating
  request: ..."; input errors say "invalid input" (code INVALID_ARG) so they are not retried.

- sampling_param_frequency_penalty and sampling_param_presence_penalty apply to the tokens
  generated so far, as on the local engine.
- sampling_param_return_perf_metrics adds the request's perf metrics to every response
  once its prompt is in the cache: kv_cache_reused_block (prompt blocks served from the
  prefix cache), kv_cache_missed_block, kv_cache_alloc_new_blocks, kv_cache_alloc_total_blocks,
  kv_cache_hit_rate; arrival_time_ns, first_scheduled_time_ns (when the engine admitted it),
  first_token_time_ns, last_token_time_ns; acceptance_rate, total_accepted_draft_tokens and
  total_draft_tokens (0: no speculative decoding here). As the real model.py does, they are
  sent with text_output's data type (strings such as "3"), whatever config.pbtxt declares.
- Decoupled or not, as the config's model_transaction_policy says (the real model takes it
  from model.yaml's triton_config.decoupled): llm_llmapi is decoupled, llm_llmapi_nondecoupled
  is this model with decoupled off, for the ModelInfer RPC (tritonclient's infer/async_infer,
  which TensorRT-LLM's llmapi_client.py uses unless it streams or stops a request). There,
  as in the real model, streaming=true is refused ("Streaming is only supported in decoupled
  mode.") and each request gets one response.

Refused as invalid input (the local engine has no such thing): best_of > 1, image_url and
LoRA.

Metrics of its own (not TensorRT-LLM's), for tests: llm_llmapi_active_requests,
llm_llmapi_cancelled_requests (ended by their client's cancellation) and
llm_llmapi_generated_tokens.

Parameters (config.pbtxt): model_dir, engine (hf | synthetic), device, dtype,
max_active_requests, tokens_per_block, kv_cache_max_blocks."""

import json
import os
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils
from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# The local engine's code is in the llm_engine model beside this one (the launcher copies
# the repository whole, so the relative path holds in its copy too).
_ENGINE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir, "llm_engine", "1")
sys.path.insert(0, os.path.normpath(_ENGINE_DIR))

from engine import Engine, HfBackend, Sampling, Sequence, SyntheticBackend  # noqa: E402
from kv_blocks import BlockCache  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
CANCELLED = "Request cancelled by client"
DEFAULT_MAX_TOKENS = 32  # TensorRT-LLM's SamplingParams.max_tokens

# Inputs the local engine cannot honour: refused unless absent or neutral.
_NEUTRAL = {
    "sampling_param_best_of": 1,
}
_ABSENT = ("image_url", "lora_id", "lora_name", "lora_path", "lora_ckpt_source")


class InvalidInput(ValueError):
    pass


def scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    array = tensor.as_numpy()
    if array.size != 1:
        raise InvalidInput(f"{name} must hold one value")
    value = array.reshape(-1)[0]
    return value.item() if isinstance(value, np.generic) else value


def strings(request, name) -> list[str]:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1)]


def text_tensor(name: str, value: str) -> "pb_utils.Tensor":
    return pb_utils.Tensor(name, np.array([value.encode("utf-8")], dtype=np.object_))


class Generation:
    """One request: the tokens the engine sent for it, its text so far, its responses."""

    def __init__(self, model, request, prompt: list[int], prefix: str, stops: list[tuple[str, list[int]]],
                 max_new: int, streaming: bool) -> None:
        self.model = model
        self.request = request
        self.sender = request.get_response_sender()
        self.prompt = prompt
        self.prefix = prefix  # the prompt's text, unless exclude_input_from_output
        self.stops = stops
        self.max_new = max_new
        self.streaming = streaming
        self.returns = {
            name: bool(scalar(request, f"return_{name}", False))
            for name in ("finish_reason", "stop_reason", "cumulative_logprob")
        }
        self.perf_metrics = bool(scalar(request, "sampling_param_return_perf_metrics", False))
        self.sequence: Sequence | None = None  # the engine's sequence (its prefix-cache hits)
        self.arrival_ns = time.time_ns()
        self.tokens: list[int] = []  # generated ids streamed so far
        self.text = prefix  # the text so far
        self.decoder = DecodeStream(skip_special_tokens=True)
        self.stopped = False  # a `stop` request named it

    def cancelled(self) -> bool:
        return bool(self.sender.is_cancelled() or self.request.is_cancelled())

    def on_tokens(self, tokens: list[int], final: bool) -> None:
        """The engine's callback: new tokens, the last call with final=True."""
        self.model.generated.increment(len(tokens))
        if not final:
            self.tokens += tokens
            for token in tokens:
                self.text += self.decoder.step(self.model.tokenizer, token) or ""
            self._respond(self.text, None, None, final=False)
            return
        self.model.finished(self)
        if self.cancelled() or (self.stopped and not self.streaming):
            if self.cancelled():
                self.model.cancelled.increment(1)
            error = pb_utils.TritonError(CANCELLED, pb_utils.TritonError.CANCELLED)
            self._send(pb_utils.InferenceResponse(error=error))
            return
        everything = self.tokens + tokens
        finish, stop_reason, kept = self._finish(everything)
        # Streaming: the text already sent stays, even the start of a stop string.
        covered = max(len(self.tokens), len(kept)) if self.streaming else len(kept)
        text = self.prefix + self.model.tokenizer.decode(everything[:covered], skip_special_tokens=True)
        if self.streaming and not text.startswith(self.text):
            text = self.text
        self._respond(text, finish, stop_reason, final=True)

    def on_error(self, message: str) -> None:
        self.model.finished(self)
        invalid = message.startswith("invalid input")
        code = pb_utils.TritonError.INVALID_ARG if invalid else pb_utils.TritonError.INTERNAL
        error = pb_utils.TritonError(f"Error generating request: {message}", code)
        outputs = [text_tensor("text_output", "N/A")]
        self._send(pb_utils.InferenceResponse(output_tensors=outputs, error=error))

    def _finish(self, everything: list[int]) -> tuple[str, str | None, list[int]]:
        """finish_reason, stop_reason, and the tokens the text keeps."""
        if self.stopped:
            return "cancelled", None, everything
        for word, ids in self.stops:
            if ids and everything[-len(ids):] == ids:
                return "stop", word, everything[: -len(ids)]
        if len(everything) >= self.max_new:
            return "length", None, everything
        return "stop", None, everything  # the end id

    def _respond(self, text: str, finish: str | None, stop_reason: str | None, *, final: bool) -> None:
        outputs = [text_tensor("text_output", text)]
        if self.returns["finish_reason"]:
            outputs.append(text_tensor("finish_reason", str(finish)))
        if self.returns["stop_reason"]:
            outputs.append(text_tensor("stop_reason", str(stop_reason)))
        if self.returns["cumulative_logprob"]:
            outputs.append(text_tensor("cumulative_logprob", str(None)))
        if self.perf_metrics and self.sequence is not None and self.sequence.phase != "waiting":
            total = -(-len(self.prompt) // self.model.tokens_per_block)
            reused = self.sequence.reused_blocks
            now = time.time_ns()
            first_token, last_token = self.sequence.first_token_ns or now, self.sequence.last_token_ns or now
            metrics = {
                "kv_cache_reused_block": reused,
                "kv_cache_missed_block": total - reused,
                "kv_cache_alloc_new_blocks": total - reused,
                "kv_cache_alloc_total_blocks": total,
                "kv_cache_hit_rate": reused / total if total else 0.0,
                "arrival_time_ns": self.arrival_ns,
                "first_scheduled_time_ns": self.sequence.scheduled_ns or now,
                "first_token_time_ns": first_token,
                "last_token_time_ns": last_token,
                "acceptance_rate": 0.0,  # (no speculative decoding here)
                "total_accepted_draft_tokens": 0,
                "total_draft_tokens": 0,
            }
            outputs.extend(text_tensor(name, str(value)) for name, value in metrics.items())
        self._send(pb_utils.InferenceResponse(output_tensors=outputs), final=final)

    def _send(self, response, *, final: bool = True) -> None:
        try:
            self.sender.send(response, flags=FINAL if final else 0)
        except Exception:
            pass  # the client went away


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "llm_llmapi"))
        # The real model's triton_config.decoupled (model.yaml), here the config's policy.
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = os.path.expandvars(params.get("model_dir", ""))
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        if params.get("engine", "hf") == "synthetic":
            backend = SyntheticBackend(
                self._word_tokens(), prefill_us_per_token=200.0, decode_us=20000.0, context_length=4096
            )
            self.end_id = -1
        else:
            import torch

            device = params.get("device", "auto")
            if device == "auto":
                device = "cuda" if torch.cuda.is_available() else "cpu"
            dtype = params.get("dtype", "auto")
            if dtype == "auto":
                dtype = "float16" if device.startswith("cuda") else "float32"
            backend = HfBackend(model_dir, device=device, dtype=dtype)
            eos = getattr(backend.model.generation_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
            self.end_id = int(eos) if eos is not None else -1
        self.tokens_per_block = int(params.get("tokens_per_block", "32"))
        cache = BlockCache(self.tokens_per_block, int(params.get("kv_cache_max_blocks", "128")))
        self.running: dict[str, list[Generation]] = {}  # request id -> its generations, for `stop`
        self.lock = threading.Lock()
        self._metrics()
        self.engine = Engine(
            backend, cache, max_active=int(params.get("max_active_requests", "8")), on_step=lambda engine: None
        )

    def _word_tokens(self) -> list[int]:
        """Ids of plain lower-case words with a leading space: the synthetic engine's text."""
        words = []
        for token_id in sorted(self.tokenizer.get_vocab().values()):
            text = self.tokenizer.decode([token_id])
            if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha() and text[1:].islower():
                words.append(token_id)
        return words[:2000]

    def _metrics(self):
        labels = {"model": self.model_name}
        active = pb_utils.MetricFamily(
            name="llm_llmapi_active_requests", description="Requests generating or waiting in the stand-in",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        cancelled = pb_utils.MetricFamily(
            name="llm_llmapi_cancelled_requests", description="Requests ended by their client's cancellation",
            kind=pb_utils.MetricFamily.COUNTER,
        )
        generated = pb_utils.MetricFamily(
            name="llm_llmapi_generated_tokens", description="Tokens generated", kind=pb_utils.MetricFamily.COUNTER
        )
        self.active = active.Metric(labels=labels)
        self.cancelled = cancelled.Metric(labels=labels)
        self.generated = generated.Metric(labels=labels)
        self._families = (active, cancelled, generated)  # keep them alive

    def finished(self, generation: Generation) -> None:
        with self.lock:
            rid = generation.request.request_id()
            others = [g for g in self.running.get(rid, []) if g is not generation]
            if others:
                self.running[rid] = others
            else:
                self.running.pop(rid, None)
            self.active.set(sum(len(g) for g in self.running.values()))

    # -- requests -------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            if scalar(request, "stop", False):
                self._stop(request)
                continue
            try:
                generation, sequence = self._generation(request)
            except InvalidInput as exc:
                error = pb_utils.TritonError(
                    f"Error generating request: invalid input: {exc}", pb_utils.TritonError.INVALID_ARG
                )
                response = pb_utils.InferenceResponse(output_tensors=[text_tensor("text_output", "N/A")], error=error)
                request.get_response_sender().send(response, flags=FINAL)
                continue
            with self.lock:
                self.running.setdefault(request.request_id(), []).append(generation)
                self.active.set(sum(len(g) for g in self.running.values()))
            self.engine.submit(sequence)
        return None

    def _stop(self, request) -> None:
        """TensorRT-LLM's `stop` input: end the requests with this request id."""
        sender = request.get_response_sender()
        rid = request.request_id()
        if not rid:
            error = pb_utils.TritonError("A request id must be provided for request cancellation")
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        with self.lock:
            for generation in self.running.get(rid, []):
                generation.stopped = True
        # Answered before the engine ends the stopped request, as the real model answers it
        # before the aborted request's generator winds down.
        error = pb_utils.TritonError(CANCELLED, pb_utils.TritonError.CANCELLED)
        sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        self.engine.stop_request(rid)

    def _generation(self, request) -> tuple[Generation, Sequence]:
        texts = pb_utils.get_input_tensor_by_name(request, "text_input")
        if texts is None:
            raise InvalidInput("text_input is missing from the request")
        array = texts.as_numpy()
        if array.ndim > 1:
            raise InvalidInput("text_input must be a 1-D tensor (one prompt)")
        prompt_text = array[0].decode("utf-8") if isinstance(array[0], bytes) else str(array[0])
        for name, neutral in _NEUTRAL.items():
            value = scalar(request, name, neutral)
            if value != neutral:
                raise InvalidInput(f"{name}={value} is not supported by this stand-in")
        for name in _ABSENT:
            if pb_utils.get_input_tensor_by_name(request, name) is not None:
                raise InvalidInput(f"{name} is not supported by this stand-in")
        prompt = self.tokenizer.encode(prompt_text).ids
        if not prompt:
            raise InvalidInput("text_input is empty after tokenization")
        max_tokens = int(scalar(request, "sampling_param_max_tokens", DEFAULT_MAX_TOKENS))
        if max_tokens < 1:
            raise InvalidInput("sampling_param_max_tokens must be at least 1")
        try:
            self.engine.backend.check(prompt, max_tokens)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        words = strings(request, "sampling_param_stop")
        stops = [(word, self.tokenizer.encode(word, add_special_tokens=False).ids) for word in words]
        streaming = bool(scalar(request, "streaming", False))
        if streaming and not self.decoupled:
            raise InvalidInput("Streaming is only supported in decoupled mode.")
        exclude = bool(scalar(request, "sampling_param_exclude_input_from_output", False))
        prefix = "" if exclude else self.tokenizer.decode(prompt, skip_special_tokens=True)
        sampling = Sampling(
            max_new=self.engine.backend.budget(prompt, max_tokens),
            end_id=self.end_id,
            top_k=int(scalar(request, "sampling_param_top_k", 0)),
            top_p=float(scalar(request, "sampling_param_top_p", 0.0)),
            temperature=float(scalar(request, "sampling_param_temperature", 1.0)),
            seed=int(scalar(request, "sampling_param_seed", 0)),
            presence_penalty=float(scalar(request, "sampling_param_presence_penalty", 0.0)),
            frequency_penalty=float(scalar(request, "sampling_param_frequency_penalty", 0.0)),
            stop_words=[ids for _, ids in stops if ids],
        )
        generation = Generation(self, request, prompt, prefix, stops, sampling.max_new, streaming)
        sequence = Sequence(
            request_id=request.request_id(), prompt=prompt, sampling=sampling, streaming=streaming,
            send=generation.on_tokens, fail=generation.on_error, cancelled=generation.cancelled,
        )
        generation.sequence = sequence
        return generation, sequence

    def finalize(self):
        self.engine.close()
