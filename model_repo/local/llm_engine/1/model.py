"""llm_engine: a CPU or CUDA stand-in for TensorRT-LLM's `tensorrt_llm` model, with exactly its
inputs and outputs (model_repo/trtllm/trtllm_tensorrt_llm/config.pbtxt).

Token ids in, token ids out; decoupled (streaming sends each new token as it is made,
as TensorRT-LLM does); in-flight batching: the running requests advance one token each
per forward pass, new ones join between steps (engine.py); a cancelled
request, or a `stop` request with its id, ends within one step; a block prefix KV cache
(kv_blocks.py) reuses whole prompt blocks across requests.

As TensorRT-LLM's engine does, on request: return_log_probs adds output_log_probs (each new
token's log-probability, [1, 1, tokens]) and cum_log_probs (their sum so far) to every
response; return_generation_logits adds generation_logits ([1, 1, tokens, vocabulary], the
raw logits of each new token); return_perf_metrics adds kv_cache_reused_blocks,
kv_cache_alloc_new_blocks and kv_cache_alloc_total_blocks to every response (this request's
prompt blocks served from the prefix cache, computed, and in all); guided_decoding_guide_type
and guided_decoding_guide constrain the output to a grammar (guided.py, on llguidance);
presence_penalty and frequency_penalty apply to the tokens generated so far (the hf engine).
The synthetic engine makes seeded random logits for those requests (engine.py); its echo
form makes none and refuses them.

It reports TensorRT-LLM's metric families (nv_trt_llm_kv_cache_block_metrics,
nv_trt_llm_request_metrics) through the python backend's custom-metrics API, so the gateway
reads both profiles alike.

Parameters (config.pbtxt): model_dir, engine (hf | synthetic), device, dtype,
tokens_per_block, max_active_requests, kv_cache_memory, kv_cache_max_blocks (the last
three `auto`: sized from the device, see engine.size_limits), and for the synthetic
engine prefill_us_per_token, decode_us, context_length."""

import json
import os
import sys

import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# llm_synthetic and llm_echo run this same code from copies of llm_engine/1 (symlinks in the
# source tree); what they have no copy of (guided.py) comes from llm_engine beside them.
sys.path.append(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llm_engine", "1")))

from engine import Engine, HfBackend, Limits, Sampling, Sequence, SyntheticBackend, size_limits  # noqa: E402
from kv_blocks import BlockCache  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

# Inputs of the tensorrt_llm contract this stand-in does not implement; a request that
# sets them to something other than their neutral value is refused.
_UNSUPPORTED = {"beam_width": 1, "num_return_sequences": 1}


def scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


def text(request, name) -> str | None:
    """A one-string input (TYPE_STRING), decoded."""
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    value = tensor.as_numpy().reshape(-1)[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def word_list(tensor) -> list[list[int]]:
    """TensorRT-LLM's [batch, 2, N] word list (first row of the batch) to token sequences."""
    if tensor is None:
        return []
    array = tensor.as_numpy()
    ids, offsets = array.reshape(-1, 2, array.shape[-1])[0]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append([int(t) for t in ids[start:end]])
        start = int(end)
    return [w for w in words if w]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "llm_engine"))
        self.version = args.get("model_version", "1")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = os.path.expandvars(params.get("model_dir", ""))
        kind = params.get("engine", "hf")
        tokens_per_block = int(params.get("tokens_per_block", "32"))
        max_active = params.get("max_active_requests", "auto")
        kv_blocks = params.get("kv_cache_max_blocks", "auto")
        kv_tokens = None
        self.guides = None  # guided decoding (the hf engine only)
        if kind == "synthetic":
            echo = params.get("synthetic_output", "words") == "echo"
            tokenizer_file = os.path.join(model_dir, "tokenizer.json") if model_dir else ""
            vocab_size = 0
            if not echo and tokenizer_file and os.path.exists(tokenizer_file):
                from guided import Guides
                from tokenizers import Tokenizer

                vocab_size = Tokenizer.from_file(tokenizer_file).get_vocab_size(with_added_tokens=True)
                self.guides = Guides(tokenizer_file, vocab_size, self._eos(model_dir))
            backend = SyntheticBackend(
                self._word_tokens(model_dir),
                prefill_us_per_token=float(params.get("prefill_us_per_token", "200")),
                decode_us=float(params.get("decode_us", "20000")),
                context_length=int(params.get("context_length", "4096")),
                echo=echo,
                vocab_size=vocab_size,
            )
            self.default_end_id = -1
            # No KV, so no memory budget: the blocks only model what a prefix cache would hold.
            limits = Limits(
                max_active=8 if max_active == "auto" else int(max_active),
                kv_blocks=2048 if kv_blocks == "auto" else int(kv_blocks),
            )
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
            self.default_end_id = int(eos) if eos is not None else -1
            from guided import Guides

            vocab_size = int(backend.model.get_output_embeddings().weight.shape[0])
            self.guides = Guides(os.path.join(model_dir, "tokenizer.json"), vocab_size, max(self.default_end_id, 0))
            limits = size_limits(
                device=device,
                kv_bytes_per_token=backend.kv_bytes_per_token,
                tokens_per_block=tokens_per_block,
                context_length=backend.context_length,
                max_active=max_active,
                kv_memory=params.get("kv_cache_memory", "auto"),
                kv_blocks=kv_blocks,
                free_memory=torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else None,
            )
            kv_tokens = limits.kv_blocks * tokens_per_block
            pb_utils.Logger.log_info(
                f"{self.model_name}: {device} {dtype}, up to {limits.max_active} sequences at once, KV budget "
                f"{limits.kv_blocks} blocks of {tokens_per_block} tokens "
                f"({kv_tokens * backend.kv_bytes_per_token / 2**20:.0f} MiB)"
            )
        self.cache = BlockCache(tokens_per_block, limits.kv_blocks)
        self.max_active = limits.max_active
        self._metrics()
        self.engine = Engine(
            backend, self.cache, max_active=self.max_active, on_step=self._report, kv_tokens=kv_tokens
        )
        if params.get("weights", "").startswith("DEMO"):
            pb_utils.Logger.log_warn(f"{self.model_name}: {params['weights']} ({model_dir})")

    @staticmethod
    def _eos(model_dir: str) -> int:
        """The model's end token (config.json), for a guide's dead ends."""
        try:
            with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as handle:
                eos = json.load(handle).get("eos_token_id")
        except (OSError, ValueError):
            return 0
        eos = eos[0] if isinstance(eos, list) and eos else eos
        return int(eos) if isinstance(eos, int) else 0

    @staticmethod
    def _word_tokens(model_dir: str) -> list[int]:
        """Token ids of plain lower-case words with a leading space, for synthetic text."""
        path = os.path.join(model_dir, "tokenizer.json") if model_dir else ""
        if not path or not os.path.exists(path):
            return []
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(path)
        words = []
        for token, token_id in tokenizer.get_vocab().items():
            text = tokenizer.decode([token_id])
            if len(text) > 2 and text[0] == " " and text[1:].isalpha() and text[1:].islower() and text.isascii():
                words.append(token_id)
        return sorted(words)[:2000]

    # -- metrics (TensorRT-LLM's names) --------------------------------------------------

    def _metrics(self):
        labels = {"model": self.model_name, "version": str(self.version)}
        blocks = pb_utils.MetricFamily(
            name="nv_trt_llm_kv_cache_block_metrics", description="TRT LLM KV cache block metrics",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        requests = pb_utils.MetricFamily(
            name="nv_trt_llm_request_metrics", description="TRT LLM request metrics",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.block_metrics = {
            kind: blocks.Metric(labels={"kv_cache_block_type": kind, **labels})
            for kind in ("max", "free", "used", "tokens_per", "reused", "fraction")
        }
        self.request_metrics = {
            kind: requests.Metric(labels={"request_type": kind, **labels})
            for kind in ("waiting", "scheduled", "context", "generation", "active", "max")
        }
        # Not a TensorRT-LLM metric: the stand-in's own count of prompt tokens it computed
        # (not served from the prefix cache), so tests can see what a cache hit saved.
        prefill = pb_utils.MetricFamily(
            name="llm_engine_prefilled_tokens", description="Prompt tokens computed in the context phase",
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.prefilled_metric = prefill.Metric(labels=labels)
        self.block_metrics["max"].set(self.cache.max_blocks)
        self.block_metrics["tokens_per"].set(self.cache.tokens_per_block)
        self.request_metrics["max"].set(self.max_active)
        self._families = (blocks, requests, prefill)  # keep them alive

    def _report(self, engine):
        tpb = self.cache.tokens_per_block
        used = min(self.cache.max_blocks, sum(s.blocks(tpb) for s in engine.active))
        b, r = self.block_metrics, self.request_metrics
        b["used"].set(used)
        b["free"].set(self.cache.max_blocks - used)
        b["fraction"].set(used / self.cache.max_blocks if self.cache.max_blocks else 0.0)
        b["reused"].set(self.cache.reused_total)
        waiting = len(engine.waiting)
        scheduled = len(engine.active)
        r["waiting"].set(waiting)
        r["scheduled"].set(scheduled)
        r["context"].set(engine.context_now)
        r["generation"].set(scheduled - engine.context_now)
        r["active"].set(scheduled + waiting)
        self.prefilled_metric.set(engine.prefilled_total)

    # -- requests -------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            if scalar(request, "stop", False):
                self.engine.stop_request(request.request_id())
                request.get_response_sender().send(flags=FINAL)
                continue
            sender = request.get_response_sender()
            try:
                self.engine.submit(self._sequence(request, sender))
            except ValueError as exc:
                error = pb_utils.TritonError(f"invalid input: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        return None

    def _sequence(self, request, sender) -> Sequence:
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
        if ids_tensor is None:
            raise ValueError("input_ids is required")
        input_ids = ids_tensor.as_numpy()
        if input_ids.ndim == 2 and input_ids.shape[0] != 1:
            raise ValueError("send one prompt per request (batch size 1)")
        row = input_ids.reshape(-1)
        length = int(scalar(request, "input_lengths", row.shape[0]))
        prompt = row[:length].astype(np.int64).tolist()
        if not prompt:
            raise ValueError("input_ids is empty")
        for name, neutral in _UNSUPPORTED.items():
            if int(scalar(request, name, neutral)) != neutral:
                raise ValueError(f"{name} other than {neutral} is not supported")
        if not bool(scalar(request, "exclude_input_in_output", True)):
            raise ValueError("exclude_input_in_output=false is not supported")
        max_new = int(scalar(request, "request_output_len", 16))
        if max_new < 1:
            raise ValueError("request_output_len must be at least 1")
        self.engine.backend.check(prompt, max_new)
        log_probs = bool(scalar(request, "return_log_probs", False))
        generation_logits = bool(scalar(request, "return_generation_logits", False))
        perf_metrics = bool(scalar(request, "return_perf_metrics", False))
        num_input_tokens = bool(scalar(request, "return_num_input_tokens", False))
        num_output_tokens = bool(scalar(request, "return_num_output_tokens", False))
        arrival_ns = time.time_ns()
        token_times: list[int] = []  # the first and the latest response with tokens
        guide_type = text(request, "guided_decoding_guide_type")
        guide = None
        if self.guides is None and (log_probs or generation_logits or guide_type):
            raise ValueError("the echo engine makes no logits: no log probabilities, logits or guided decoding")
        if guide_type and self.guides is not None:
            guide = self.guides.new(guide_type, text(request, "guided_decoding_guide") or "")
        sampling = Sampling(
            max_new=self.engine.backend.budget(prompt, max_new),
            end_id=int(scalar(request, "end_id", self.default_end_id)),
            top_k=int(scalar(request, "runtime_top_k", 0)),
            top_p=float(scalar(request, "runtime_top_p", 0.0)),
            temperature=float(scalar(request, "temperature", 1.0)),
            repetition_penalty=float(scalar(request, "repetition_penalty", 1.0)),
            presence_penalty=float(scalar(request, "presence_penalty", 0.0)),
            frequency_penalty=float(scalar(request, "frequency_penalty", 0.0)),
            seed=int(scalar(request, "seed", 0)),
            stop_words=word_list(pb_utils.get_input_tensor_by_name(request, "stop_words_list")),
            bad_words=word_list(pb_utils.get_input_tensor_by_name(request, "bad_words_list")),
            log_probs=log_probs,
            generation_logits=generation_logits,
            guide=guide,
        )
        tpb = self.cache.tokens_per_block

        def send(tokens: list[int], final: bool) -> None:
            if final and not tokens and streaming:
                sender.send(flags=FINAL)
                return
            first = len(sequence.generated) - len(tokens)  # (the engine sends the last ones)
            ids = np.array(tokens, dtype=np.int32).reshape(1, 1, -1)
            outputs = [
                pb_utils.Tensor("output_ids", ids),
                pb_utils.Tensor("sequence_length", np.array([[len(tokens)]], dtype=np.int32)),
            ]
            end = first + len(tokens)
            if log_probs:
                values = sequence.logprobs[first:end]
                outputs.append(pb_utils.Tensor("output_log_probs", np.array(values, dtype=np.float32).reshape(1, 1, -1)))
                total = float(sum(sequence.logprobs[:end]))
                outputs.append(pb_utils.Tensor("cum_log_probs", np.array([[total]], dtype=np.float32)))
            if generation_logits:
                rows = sequence.logits[first:end]
                width = rows[0].shape[-1] if rows else self.guides.vocab_size
                array = np.stack(rows).astype(np.float32) if rows else np.zeros((0, width), dtype=np.float32)
                outputs.append(pb_utils.Tensor("generation_logits", array.reshape(1, 1, len(rows), width)))
            # Token counts as TensorRT-LLM returns them: the prompt's, and this response's.
            if num_input_tokens:
                outputs.append(pb_utils.Tensor("num_input_tokens", np.array([[len(prompt)]], dtype=np.int32)))
            if num_output_tokens:
                outputs.append(pb_utils.Tensor("num_output_tokens", np.array([[len(tokens)]], dtype=np.int32)))
            if perf_metrics:
                now = time.time_ns()
                if tokens:
                    token_times[:] = [token_times[0] if token_times else now, now]
                first_token, last_token = token_times or [now, now]
                total_blocks = -(-len(prompt) // tpb)
                for name, value in (
                    ("kv_cache_reused_blocks", sequence.reused_blocks),
                    ("kv_cache_alloc_new_blocks", total_blocks - sequence.reused_blocks),
                    ("kv_cache_alloc_total_blocks", total_blocks),
                    ("total_accepted_draft_tokens", 0),  # (no speculative decoding here)
                    ("total_draft_tokens", 0),
                ):
                    outputs.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int32)))
                # (This engine does not record when a request was first scheduled: its first
                # step makes its first token, so that time stands for both.)
                for name, value in (
                    ("arrival_time_ns", arrival_ns),
                    ("first_scheduled_time_ns", first_token),
                    ("first_token_time_ns", first_token),
                    ("last_token_time_ns", last_token),
                ):
                    outputs.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int64)))
                outputs.append(pb_utils.Tensor("acceptance_rate", np.array([[0.0]], dtype=np.float32)))
            sender.send(pb_utils.InferenceResponse(output_tensors=outputs), flags=FINAL if final else 0)

        def fail(message: str) -> None:
            code = pb_utils.TritonError.INVALID_ARG if message.startswith("invalid input") else pb_utils.TritonError.INTERNAL
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), flags=FINAL)

        def cancelled() -> bool:
            return bool(
                (hasattr(sender, "is_cancelled") and sender.is_cancelled())
                or (hasattr(request, "is_cancelled") and request.is_cancelled())
            )

        streaming = bool(scalar(request, "streaming", False))
        sequence = Sequence(
            request_id=request.request_id(), prompt=prompt, sampling=sampling, streaming=streaming,
            send=send, fail=fail, cancelled=cancelled,
        )
        return sequence

    def finalize(self):
        self.engine.close()
