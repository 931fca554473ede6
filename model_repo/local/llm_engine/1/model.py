"""llm_engine: a CPU or CUDA stand-in for TensorRT-LLM's `tensorrt_llm` model, with exactly its
inputs and outputs (model_repo/trtllm/trtllm_tensorrt_llm/config.pbtxt), so that
tensorrtllm_backend's own clients run against it unmodified (tests/test_trtllm_clients.py).

Token ids in, token ids out; in-flight batching: the running requests advance one token each
per forward pass, new ones join between steps (engine.py); a cancelled request, or a `stop`
request with its id, ends within one step; a block prefix KV cache (kv_blocks.py) reuses
whole prompt blocks across requests.

Decoupled or not, as the config's model_transaction_policy says (TensorRT-LLM's
decoupled_mode): decoupled, `streaming` sends each new token as it is made, and one request
may hold a batch of prompts or ask for num_return_sequences (each sequence's responses carry
batch_index / sequence_index, as TensorRT-LLM's do, and the request ends with the last of
them); not decoupled (llm_engine_nondecoupled), one response per request, which the
ModelInfer RPC (tritonclient's infer/async_infer) takes, and streaming or a batch of prompts
is refused with TensorRT-LLM's words.

As TensorRT-LLM's engine does, on request: return_log_probs adds output_log_probs (each new
token's log-probability, [1, 1, tokens]) and cum_log_probs (their sum so far) to every
response; return_generation_logits adds generation_logits ([1, 1, tokens, vocabulary], the
raw logits of each new token); return_context_logits adds context_logits ([1, prompt,
vocabulary], the raw logits of every prompt position, computed for the request: it reuses no
cached prefix) to every response; return_perf_metrics adds the KV-cache metrics
(kv_cache_reused_blocks: this request's prompt blocks served from the prefix cache,
kv_cache_alloc_new_blocks: computed, kv_cache_alloc_total_blocks: in all), the timing
metrics (arrival_time_ns, first_scheduled_time_ns: when the scheduler admitted it,
first_token_time_ns, last_token_time_ns) and the speculative-decoding ones (no draft tokens
here: acceptance_rate 0) to every response; return_num_input_tokens and
return_num_output_tokens add the prompt's length and the number of ids in this response's
output_ids; exclude_input_in_output=false (the default is the config's parameter of that
name) puts the prompt before the generated ids of a non-streaming response (a streaming one
holds new ids only, as TensorRT-LLM's); embedding_bias is added to the logits; min_tokens
holds off the end id; runtime_top_p_decay / _min / _reset_ids make top-p decay;
guided_decoding_guide_type and guided_decoding_guide constrain the output to a grammar
(guided.py, on llguidance); presence_penalty and frequency_penalty apply to the tokens
generated so far (the hf engine). lookahead_window_size / _ngram_size /
_verification_set_size are taken when the model has lookahead parameters of its own (as
TensorRT-LLM's executor needs) and the request is within them; lookahead decoding is exact
(it returns the greedy tokens, only sooner), so the tokens are the greedy ones, made one per
step (no draft tokens). beam_width above 1 is refused (no beam search here).
The synthetic engine makes seeded random logits for log probabilities, generation logits and
guides (engine.py) and refuses context logits; its echo form makes none and refuses them.

It reports TensorRT-LLM's metric families (nv_trt_llm_kv_cache_block_metrics,
nv_trt_llm_request_metrics) through the python backend's custom-metrics API, so the gateway
reads both profiles alike (set when they change, at most every 50 ms while the engine runs:
gauges.py).

Parameters (config.pbtxt): model_dir, engine (hf | synthetic), device, dtype, decode (auto:
the static cache and CUDA graphs of static_decode.py on CUDA for the models it supports, or
eager: HfBackend's decode step everywhere), decode_ahead (true: the static decode's next
greedy step launched before the engine takes this one's tokens, see static_decode.py; false
waits for them),
coalesce_streamed_tokens (auto: true on CUDA;
see responder.py), tokens_per_block, max_active_requests, kv_cache_memory, kv_cache_max_blocks (the last
three `auto`: sized from the device, see engine.size_limits), exclude_input_in_output,
lookahead_window_size, lookahead_ngram_size, lookahead_verification_set_size, and for the
synthetic engine prefill_us_per_token, decode_us, context_length."""

import json
import os
import re
import sys
import threading
import time

import numpy as np
import triton_python_backend_utils as pb_utils

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# An agent CLI's stand-in (llm_agent): what tests of the gateway's doors need from a model.
AGENT_TRIGGER = "[call the first tool]"
AGENT_ANSWER = "Hello from the stand-in."
AGENT_AFTER_TOOL = "The tool answered."
_TOOLS_BLOCK = re.compile(r"<tools>\n(\{.*)")


def agent_reply(prompt: str) -> str:
    """llm_agent's answer to a rendered prompt: once a tool's result is in it, a sentence
    saying so; else, when the prompt asks for AGENT_TRIGGER and offers tools (the gateway's
    generic tool prompt, hermes), a call of the first tool offered with no arguments; else
    a fixed sentence."""
    if "<tool_response>\n" in prompt:  # (the tool prompt itself names the tag, without a newline)
        return AGENT_AFTER_TOOL
    found = _TOOLS_BLOCK.search(prompt)
    if AGENT_TRIGGER in prompt and found is not None:
        first = json.JSONDecoder().raw_decode(found.group(1))[0]
        name = (first.get("function") or first).get("name", "")
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": {}}) + "\n</tool_call>"
    return AGENT_ANSWER


# llm_synthetic and llm_echo run this same code from copies of llm_engine/1 (symlinks in the
# source tree); what they have no copy of (guided.py) comes from llm_engine beside them.
sys.path.append(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "llm_engine", "1")))

from engine import Engine, HfBackend, Limits, Sampling, Sequence, SyntheticBackend, size_limits  # noqa: E402
from gauges import Gauges  # noqa: E402
from kv_blocks import BlockCache  # noqa: E402
from responder import Gate, Outbox, Responder  # noqa: E402
from static_decode import StaticBackend, supports  # noqa: E402

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
LOOKAHEAD = ("lookahead_window_size", "lookahead_ngram_size", "lookahead_verification_set_size")


def scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


class Rows:
    """A request's inputs, row by row (a request may hold a batch of prompts)."""

    def __init__(self, request) -> None:
        self.request = request

    def array(self, name):
        tensor = pb_utils.get_input_tensor_by_name(self.request, name)
        return None if tensor is None else tensor.as_numpy()

    def value(self, name, row, default):
        array = self.array(name)
        if array is None:
            return default
        flat = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(-1, 1)
        value = flat[min(row, flat.shape[0] - 1)][0]
        return value.item() if isinstance(value, np.generic) else value

    def text(self, name, row) -> str | None:
        """A one-string input (TYPE_STRING) of this row, decoded."""
        value = self.value(name, row, None)
        if value is None:
            return None
        return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def word_list(array, row: int) -> list[list[int]]:
    """TensorRT-LLM's [batch, 2, N] word list (this row of the batch) to token sequences."""
    if array is None:
        return []
    rows = array.reshape(-1, 2, array.shape[-1])
    ids, offsets = rows[min(row, rows.shape[0] - 1)]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append([int(t) for t in ids[start:end]])
        start = int(end)
    return [w for w in words if w]


class Group:
    """The sequences of one request: its response sender, which of them still run (the
    request's last response carries the final flag), and whether Triton cancelled it."""

    def __init__(self, sender, count: int, request=None) -> None:
        self.sender = sender
        self.request = request
        self.pending = count
        self.lock = threading.Lock()
        self.cancelled = False
        self.checked_at = time.monotonic()

    def send(self, response, final: bool) -> None:
        """A sequence's response; `final`: that sequence's last one."""
        with self.lock:
            if final:
                self.pending -= 1
            last = final and self.pending == 0
        if response is None:
            if last:
                self.sender.send(flags=FINAL)
            return
        self.sender.send(response, flags=FINAL if last else 0)

    def check_cancelled(self, older_than: float) -> bool:
        """Whether Triton cancelled the request, asked again (a round trip to the server) when
        the last answer is older than `older_than` seconds."""
        if not self.cancelled and time.monotonic() - self.checked_at >= older_than:
            self.checked_at = time.monotonic()
            self.cancelled = bool(
                (hasattr(self.sender, "is_cancelled") and self.sender.is_cancelled())
                or (self.request is not None and hasattr(self.request, "is_cancelled") and self.request.is_cancelled())
            )
        return self.cancelled


# A running request's cancellation is asked of Triton after its responses at most this
# often, and by the engine's own check when nothing was sent for it for IDLE_CANCEL_CHECK_S.
CANCEL_CHECK_S = 0.02
IDLE_CANCEL_CHECK_S = 0.2


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.model_name = args.get("model_name", config.get("name", "llm_engine"))
        self.version = args.get("model_version", "1")
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = os.path.expandvars(params.get("model_dir", ""))
        kind = params.get("engine", "hf")
        self.on_cuda = False
        tokens_per_block = int(params.get("tokens_per_block", "32"))
        max_active = params.get("max_active_requests", "auto")
        kv_blocks = params.get("kv_cache_max_blocks", "auto")
        kv_tokens = None
        self.guides = None  # guided decoding (the hf engine only)
        self.context_logits = kind != "synthetic"  # (the synthetic engine computes no prompt logits)
        self.vocab_size = 0  # the model's, for checking token ids (0: unknown)
        # TensorRT-LLM's decoupled_mode: one response per request when off (ModelInfer).
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(config)
        self.exclude_input = params.get("exclude_input_in_output", "false").strip().lower() in ("1", "true")
        # The executor's lookahead configuration: a request's may not exceed it.
        values = [params.get(name, "").strip() for name in LOOKAHEAD]
        self.lookahead = tuple(int(v) for v in values) if all(v.isdigit() for v in values) else None
        if kind == "synthetic":
            output = params.get("synthetic_output", "words")
            echo = output == "echo"
            tokenizer_file = os.path.join(model_dir, "tokenizer.json") if model_dir else ""
            vocab_size = 0
            reply = None
            if output == "agent":
                from tokenizers import Tokenizer

                agent_tokenizer = Tokenizer.from_file(tokenizer_file)

                def reply(prompt: list[int]) -> list[int]:
                    text = agent_tokenizer.decode(prompt, skip_special_tokens=False)
                    return agent_tokenizer.encode(agent_reply(text), add_special_tokens=False).ids

            if not echo and tokenizer_file and os.path.exists(tokenizer_file):
                from guided import Guides
                from tokenizers import Tokenizer

                vocab_size = Tokenizer.from_file(tokenizer_file).get_vocab_size(with_added_tokens=True)
                self.guides = Guides(tokenizer_file, vocab_size, self._eos(model_dir))
                self.vocab_size = vocab_size
            backend = SyntheticBackend(
                self._word_tokens(model_dir),
                prefill_us_per_token=float(params.get("prefill_us_per_token", "200")),
                decode_us=float(params.get("decode_us", "20000")),
                context_length=int(params.get("context_length", "4096")),
                echo=echo,
                vocab_size=vocab_size,
                reply=reply,
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
            self.on_cuda = device.startswith("cuda")
            dtype = params.get("dtype", "auto")
            if dtype == "auto":
                dtype = "float16" if device.startswith("cuda") else "float32"
            static = False
            if device.startswith("cuda") and params.get("decode", "auto") != "eager":
                from transformers import AutoConfig

                static = supports(AutoConfig.from_pretrained(model_dir))
            if static:
                ahead = params.get("decode_ahead", "true").strip().lower() in ("1", "true")
                backend = StaticBackend(model_dir, device=device, dtype=dtype, overlap=ahead)
            else:
                backend = HfBackend(model_dir, device=device, dtype=dtype)
            eos = getattr(backend.model.generation_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, list) else eos
            self.default_end_id = int(eos) if eos is not None else -1
            from guided import Guides

            vocab_size = int(backend.model.get_output_embeddings().weight.shape[0])
            self.vocab_size = vocab_size
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
            decoding = "eager decode"
            if isinstance(backend, StaticBackend):
                # The static cache holds every running sequence whole (no padded batch to
                # count); the prefix cache gets the rest of the budget.
                rows = backend.allocate(limits.max_active, kv_tokens)
                rest = max(1, (kv_tokens - backend.static_tokens) // tokens_per_block)
                limits = Limits(max_active=rows, kv_blocks=rest)
                decoding = f"static cache of {rows} x {backend.columns} tokens, CUDA-graph decode"
                kv_tokens = None
            pb_utils.Logger.log_info(
                f"{self.model_name}: {device} {dtype}, {decoding}, up to {limits.max_active} sequences at once, "
                f"prefix/KV budget {limits.kv_blocks} blocks of {tokens_per_block} tokens "
                f"({limits.kv_blocks * tokens_per_block * backend.kv_bytes_per_token / 2**20:.0f} MiB)"
            )
        self.cache = BlockCache(tokens_per_block, limits.kv_blocks)
        self.max_active = limits.max_active
        self._metrics()
        # Several tokens to a streamed response while the sender lags: on CUDA by default
        # (the engine outruns one sender there), never on the CPU (each token its own).
        coalesce = params.get("coalesce_streamed_tokens", "auto").strip().lower()
        self.coalesce = coalesce in ("1", "true") or (coalesce == "auto" and self.on_cuda)
        # Responses built while the engine waits on the GPU (responder.py's Gate): where a
        # step has such a wait, the static decode's on CUDA.
        gate = None
        if isinstance(backend, StaticBackend) and backend.use_graphs:
            gate = backend.gate = Gate()
        self.responder = Responder(lambda text: pb_utils.Logger.log_verbose(f"llm responder: {text}"), gate=gate)
        self.engine = Engine(
            backend, self.cache, max_active=self.max_active, on_step=self._report, kv_tokens=kv_tokens, gate=gate
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
        self.block_metrics["max"].set(self.cache.max_blocks)
        self.block_metrics["tokens_per"].set(self.cache.tokens_per_block)
        self.request_metrics["max"].set(self.max_active)
        self.gauges = Gauges({
            **{f"block_{kind}": self.block_metrics[kind] for kind in ("used", "free", "fraction", "reused")},
            **{kind: self.request_metrics[kind] for kind in ("waiting", "scheduled", "context", "generation", "active")},
            "prefilled": prefill.Metric(labels=labels),
        })  # fmt: skip
        self._families = (blocks, requests, prefill)  # keep them alive

    def _report(self, engine):
        waiting, scheduled = len(engine.waiting), len(engine.active)
        idle = not waiting and not scheduled
        if not self.gauges.due(idle):
            return
        tpb = self.cache.tokens_per_block
        used = min(self.cache.max_blocks, sum(s.blocks(tpb) for s in engine.active))
        self.gauges.report({
            "block_used": used,
            "block_free": self.cache.max_blocks - used,
            "block_fraction": used / self.cache.max_blocks if self.cache.max_blocks else 0.0,
            "block_reused": self.cache.reused_total,
            "waiting": waiting,
            "scheduled": scheduled,
            "context": engine.context_now,
            "generation": scheduled - engine.context_now,
            "active": scheduled + waiting,
            "prefilled": engine.prefilled_total,
        }, idle)  # fmt: skip

    # -- requests -------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            if scalar(request, "stop", False):
                self._stop(request, sender)
                continue
            try:
                sequences = self._sequences(request, Rows(request), sender)
            except ValueError as exc:
                error = pb_utils.TritonError(f"invalid input: {exc}", pb_utils.TritonError.INVALID_ARG)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            except Exception as exc:  # (a bug here must not leave the request unanswered)
                error = pb_utils.TritonError(f"{type(exc).__name__}: {exc}", pb_utils.TritonError.INTERNAL)
                sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
                continue
            self.engine.submit(*sequences)
        return None

    def _stop(self, request, sender) -> None:
        """TensorRT-LLM's `stop` input: the sequences with this request id end at their next
        step; the stop request itself is answered with an empty response (an error when it
        names no request id), as tensorrtllm_backend answers it."""
        rid = request.request_id()
        if not rid:
            error = pb_utils.TritonError("Trying to stop a request but request ID is not provided")
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
            return
        self.engine.stop_request(rid)
        sender.send(pb_utils.InferenceResponse(output_tensors=[]), flags=FINAL)

    def _sequences(self, request, rows: Rows, sender) -> list[Sequence]:
        """The engine's sequences of a request: num_return_sequences of each prompt."""
        input_ids = rows.array("input_ids")
        if input_ids is None:
            raise ValueError("input_ids is required")
        input_ids = input_ids.reshape(1, -1) if input_ids.ndim == 1 else input_ids.reshape(input_ids.shape[0], -1)
        batch = input_ids.shape[0]
        streaming = bool(scalar(request, "streaming", False))
        if not self.decoupled:
            # (tensorrtllm_backend's own checks, in its words)
            if batch > 1:
                raise ValueError("Batch size > 1 requires the tensorrt_llm backend to be using decoupled transaction policy")
            if streaming:
                raise ValueError("Streaming is only supported if model is deployed using decoupled mode.")
        plans = []
        for row in range(batch):
            count = int(rows.value("num_return_sequences", row, 1))
            if count < 1:
                raise ValueError("num_return_sequences must be at least 1")
            if count > 1 and not self.decoupled:
                raise ValueError("num_return_sequences > 1 requires the decoupled transaction policy")
            plans.extend((row, index) for index in range(count))
        group = Group(sender, len(plans), request)
        numbered = {
            "batch": batch > 1,
            "sequence": any(int(rows.value("num_return_sequences", row, 1)) > 1 for row in range(batch)),
        }
        return [
            self._sequence(request, rows, input_ids[row], row, index, streaming, group, numbered)
            for row, index in plans
        ]

    def _sequence(self, request, rows: Rows, ids, row: int, index: int, streaming: bool, group: Group,
                  numbered: dict) -> Sequence:
        length = int(rows.value("input_lengths", row, ids.shape[0]))
        prompt = ids[:length].astype(np.int64).tolist()
        if not prompt:
            raise ValueError("input_ids is empty")
        self._check_ids("input_ids", prompt)
        if int(rows.value("beam_width", row, 1)) != 1:
            raise ValueError("beam_width other than 1 is not supported (no beam search in this stand-in)")
        max_new = int(rows.value("request_output_len", row, 16))
        if max_new < 1:
            raise ValueError("request_output_len must be at least 1")
        self.engine.backend.check(prompt, max_new)
        exclude_input = bool(rows.value("exclude_input_in_output", row, self.exclude_input))
        log_probs = bool(rows.value("return_log_probs", row, False))
        generation_logits = bool(rows.value("return_generation_logits", row, False))
        context_logits = bool(rows.value("return_context_logits", row, False))
        perf_metrics = bool(rows.value("return_perf_metrics", row, False))
        num_input_tokens = bool(rows.value("return_num_input_tokens", row, False))
        num_output_tokens = bool(rows.value("return_num_output_tokens", row, False))
        arrival_ns = time.time_ns()
        guide_type = rows.text("guided_decoding_guide_type", row)
        guide = None
        if self.guides is None and (log_probs or generation_logits or context_logits or guide_type):
            raise ValueError("the echo engine makes no logits: no log probabilities, logits or guided decoding")
        if not self.context_logits:  # (the synthetic engines)
            if context_logits:
                raise ValueError("the synthetic engine computes no context logits")
            bias = rows.array("embedding_bias")
            if rows.value("min_tokens", row, 0) or (bias is not None and bias.size):
                raise ValueError("the synthetic engine takes no min_tokens or embedding_bias (it makes no real logits)")
        if guide_type and self.guides is not None:
            guide = self.guides.new(guide_type, rows.text("guided_decoding_guide", row) or "")
        stop_words = word_list(rows.array("stop_words_list"), row)
        bad_words = word_list(rows.array("bad_words_list"), row)
        for name, words in (("stop_words_list", stop_words), ("bad_words_list", bad_words)):
            self._check_ids(name, [t for word in words for t in word])
        sampling = Sampling(
            max_new=self.engine.backend.budget(prompt, max_new),
            end_id=int(rows.value("end_id", row, self.default_end_id)),
            top_k=int(rows.value("runtime_top_k", row, 0)),
            top_p=float(rows.value("runtime_top_p", row, 0.0)),
            top_p_decay=float(rows.value("runtime_top_p_decay", row, 1.0)),
            top_p_min=float(rows.value("runtime_top_p_min", row, 1e-6)),
            top_p_reset_id=int(rows.value("runtime_top_p_reset_ids", row, -1)),
            temperature=float(rows.value("temperature", row, 1.0)),
            repetition_penalty=float(rows.value("repetition_penalty", row, 1.0)),
            presence_penalty=float(rows.value("presence_penalty", row, 0.0)),
            frequency_penalty=float(rows.value("frequency_penalty", row, 0.0)),
            # Each of num_return_sequences samples with its own seed.
            seed=int(rows.value("seed", row, 0)) + index,
            min_tokens=int(rows.value("min_tokens", row, 0)),
            cache_salt_id=int(rows.value("cache_salt_id", row, 0)),
            embedding_bias=self._embedding_bias(rows, row),
            stop_words=stop_words,
            bad_words=bad_words,
            log_probs=log_probs,
            generation_logits=generation_logits,
            context_logits=context_logits,
            guide=guide,
        )
        self._check_lookahead(rows, row, sampling)
        tpb = self.cache.tokens_per_block
        extra = []  # batch_index / sequence_index, as TensorRT-LLM sends them
        if numbered["batch"]:
            extra.append(pb_utils.Tensor("batch_index", np.array([[row]], dtype=np.int32)))
        if numbered["sequence"]:
            extra.append(pb_utils.Tensor("sequence_index", np.array([[index]], dtype=np.int32)))

        def send(tokens: list[int], final: bool) -> None:  # (on the engine's thread: queued)
            first = len(sequence.generated) - len(tokens)  # (the engine sends the last ones)
            self.responder.put(outbox, ("tokens", first, list(tokens), final, sequence.last_token_ns))

        def respond(first: int, tokens: list[int], final: bool, last_token_ns: int) -> None:
            if final and not tokens and streaming:
                group.send(None, True)
                return
            # A response that is not streamed holds the prompt first unless it is excluded.
            ids = tokens if streaming or exclude_input else prompt + tokens
            outputs = [
                pb_utils.Tensor("output_ids", np.array(ids, dtype=np.int32).reshape(1, 1, -1)),
                pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32)),
                *extra,
            ]
            end = first + len(tokens)
            if log_probs:
                values = sequence.logprobs[first:end]
                outputs.append(pb_utils.Tensor("output_log_probs", np.array(values, dtype=np.float32).reshape(1, 1, -1)))
                total = float(sum(sequence.logprobs[:end]))
                outputs.append(pb_utils.Tensor("cum_log_probs", np.array([[total]], dtype=np.float32)))
            if generation_logits:
                steps = sequence.logits[first:end]
                width = steps[0].shape[-1] if steps else self.guides.vocab_size
                array = np.stack(steps).astype(np.float32) if steps else np.zeros((0, width), dtype=np.float32)
                outputs.append(pb_utils.Tensor("generation_logits", array.reshape(1, 1, len(steps), width)))
            if context_logits and sequence.context_logits is not None:
                logits = sequence.context_logits
                outputs.append(pb_utils.Tensor("context_logits", logits.reshape(1, *logits.shape).astype(np.float32)))
            # Token counts as TensorRT-LLM returns them: the prompt's, and this response's ids.
            if num_input_tokens:
                outputs.append(pb_utils.Tensor("num_input_tokens", np.array([[len(prompt)]], dtype=np.int32)))
            if num_output_tokens:
                outputs.append(pb_utils.Tensor("num_output_tokens", np.array([[len(ids)]], dtype=np.int32)))
            if perf_metrics:
                now = time.time_ns()
                first_token, last_token = sequence.first_token_ns or now, last_token_ns or now
                total_blocks = -(-len(prompt) // tpb)
                for name, value in (
                    ("kv_cache_reused_blocks", sequence.reused_blocks),
                    ("kv_cache_alloc_new_blocks", total_blocks - sequence.reused_blocks),
                    ("kv_cache_alloc_total_blocks", total_blocks),
                    ("total_accepted_draft_tokens", 0),  # (no speculative decoding here)
                    ("total_draft_tokens", 0),
                ):
                    outputs.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int32)))
                for name, value in (
                    ("arrival_time_ns", arrival_ns),
                    ("first_scheduled_time_ns", sequence.scheduled_ns or now),
                    ("first_token_time_ns", first_token),
                    ("last_token_time_ns", last_token),
                ):
                    outputs.append(pb_utils.Tensor(name, np.array([[value]], dtype=np.int64)))
                outputs.append(pb_utils.Tensor("acceptance_rate", np.array([[0.0]], dtype=np.float32)))
            group.send(pb_utils.InferenceResponse(output_tensors=outputs), final)

        def fail(message: str) -> None:  # (on the engine's thread: queued)
            self.responder.put(outbox, ("error", message))

        def respond_error(message: str) -> None:
            code = pb_utils.TritonError.INVALID_ARG if message.startswith("invalid input") else pb_utils.TritonError.INTERNAL
            group.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code)), True)

        def cancelled() -> bool:
            return group.check_cancelled(IDLE_CANCEL_CHECK_S)

        def after_responses() -> None:
            # Never once the request's final response went: its sender is gone then (asking
            # it crashed the stub).
            if group.pending > 0:
                group.check_cancelled(CANCEL_CHECK_S)

        outbox = Outbox(respond, respond_error, after_responses, coalesce=self.coalesce)
        sequence = Sequence(
            request_id=request.request_id(), prompt=prompt, sampling=sampling, streaming=streaming,
            send=send, fail=fail, cancelled=cancelled,
        )
        return sequence

    def _check_ids(self, name: str, ids: list[int]) -> None:
        if self.vocab_size and any(not 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"{name} holds token ids outside the vocabulary [0, {self.vocab_size})")

    def _embedding_bias(self, rows: Rows, row: int):
        """This row's embedding_bias ([vocabulary] FP32), or None (absent or empty)."""
        array = rows.array("embedding_bias")
        if array is None or array.size == 0:
            return None
        array = array.reshape(array.shape[0], -1) if array.ndim > 1 else array.reshape(1, -1)
        bias = np.ascontiguousarray(array[min(row, array.shape[0] - 1)], dtype=np.float32)
        if not bias.size:
            return None
        if self.guides is None:
            raise ValueError("the echo engine makes no logits: no embedding bias")
        if self.vocab_size and bias.size > self.vocab_size:
            raise ValueError(f"embedding_bias has {bias.size} values; the vocabulary {self.vocab_size}")
        return bias

    def _check_lookahead(self, rows: Rows, row: int, sampling: Sampling) -> None:
        """Lookahead decoding, as TensorRT-LLM's executor takes it: all three sizes, within
        the model's own lookahead configuration, with greedy sampling (what it speeds up)."""
        given = [rows.value(name, row, None) for name in LOOKAHEAD]
        if all(value is None for value in given):
            return
        if any(value is None for value in given):
            raise ValueError(f"lookahead decoding needs all of {', '.join(LOOKAHEAD)}")
        if self.lookahead is None:
            raise ValueError(
                "Cannot set the request lookahead decoding configuration when model instance lookahead "
                "parameters are not set."
            )
        window, ngram, verification = (int(v) for v in given)
        if window < 1 or ngram < 1 or verification < 0:
            raise ValueError("lookahead sizes: window and ngram at least 1, verification set at least 0")
        limit = self.lookahead
        if window > limit[0] or ngram > limit[1] or verification > limit[2]:
            raise ValueError(f"the lookahead configuration [{window},{ngram},{verification}] exceeds the model's {list(limit)}")
        if not sampling.greedy:
            raise ValueError("lookahead decoding takes greedy sampling only (runtime_top_k 1 or 0, no runtime_top_p)")

    def finalize(self):
        self.engine.close()
        self.responder.close()
