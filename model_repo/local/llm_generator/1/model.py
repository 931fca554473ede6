"""Token-by-token generation with a Hugging Face causal LM on CPU (decoupled).

Each request runs in a worker thread and streams chunks of token ids through its
response sender. A chunk is cut only where the tokens so far decode to whole
characters, so detokenizing chunk by chunk gives the same text as decoding all of them.
The last response carries TRITONSERVER_RESPONSE_COMPLETE_FINAL.

A running generation ends at its next step when its request is cancelled (a direct
request) or when a `stop` request with the same request id arrives (through the
ensemble, where Triton 2.51 does not pass cancellation on to a running step)."""

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
# A stop may arrive before its request starts; it is kept this long.
STOP_TTL_S = 300.0


def word_list(tensor) -> list[list[int]]:
    """TensorRT-LLM's [2, N] word list (first row of the batch) to token sequences."""
    if tensor is None:
        return []
    ids, offsets = tensor.as_numpy().reshape(-1, 2, tensor.as_numpy().shape[-1])[0]
    words, start = [], 0
    for end in offsets:
        if end < 0:
            break
        words.append([int(t) for t in ids[start:end]])
        start = int(end)
    return [w for w in words if w]


def scalar(request, name, default):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return default if tensor is None else tensor.as_numpy().reshape(-1)[0].item()


@dataclass
class Sampling:
    max_tokens: int
    end_id: int
    top_k: int
    top_p: float
    temperature: float
    repetition_penalty: float
    seed: int
    stream: bool
    stop_words: list[list[int]]
    bad_words: list[list[int]]

    @property
    def greedy(self) -> bool:
        # TensorRT-LLM's rule: no top_k above 1 and no top_p means greedy search.
        return self.temperature <= 0 or (self.top_k <= 1 and self.top_p <= 0)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        model_dir = os.path.expandvars(params["model_dir"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.context_length = int(getattr(self.model.config, "max_position_embeddings", 0) or getattr(self.model.config, "n_positions", 1024))
        self.default_end_id = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else -1
        workers = int(params.get("max_concurrent_requests", "8"))
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="generate")
        self.stops: dict[str, float] = {}  # request id -> when the stop arrived
        self.stops_lock = threading.Lock()
        if params.get("weights", "").startswith("DEMO"):
            pb_utils.Logger.log_warn(f"llm_generator: {params['weights']} ({model_dir})")

    def execute(self, requests):
        for request in requests:
            if scalar(request, "stop", False):
                self._record_stop(request)
            else:
                self.pool.submit(self._run, request)
        return None

    def _record_stop(self, request):
        now = time.monotonic()
        with self.stops_lock:
            self.stops = {rid: at for rid, at in self.stops.items() if now - at < STOP_TTL_S}
            if request.request_id():
                self.stops[request.request_id()] = now
        request.get_response_sender().send(flags=FINAL)

    def _stopped(self, request) -> bool:
        request_id = request.request_id()
        return bool(request_id) and request_id in self.stops

    def finalize(self):
        self.pool.shutdown(wait=True, cancel_futures=True)

    def _run(self, request):
        sender = request.get_response_sender()
        try:
            self._generate(request, sender)
        except ValueError as exc:  # a request we cannot serve as asked
            error = pb_utils.TritonError(f"invalid input: {exc}", pb_utils.TritonError.INVALID_ARG)
            sender.send(pb_utils.InferenceResponse(error=error), flags=FINAL)
        except Exception as exc:  # report to this request only; the model keeps serving
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"llm generator: {exc}")), flags=FINAL)
        finally:
            with self.stops_lock:
                self.stops.pop(request.request_id(), None)

    def _sampling(self, request) -> Sampling:
        return Sampling(
            max_tokens=int(scalar(request, "request_output_len", 16)),
            end_id=int(scalar(request, "end_id", self.default_end_id)),
            top_k=int(scalar(request, "runtime_top_k", 0)),
            top_p=float(scalar(request, "runtime_top_p", 0.0)),
            temperature=float(scalar(request, "temperature", 1.0)),
            repetition_penalty=float(scalar(request, "repetition_penalty", 1.0)),
            seed=int(scalar(request, "random_seed", 0)),
            stream=bool(scalar(request, "streaming", False)),
            stop_words=word_list(pb_utils.get_input_tensor_by_name(request, "stop_words_list")),
            bad_words=word_list(pb_utils.get_input_tensor_by_name(request, "bad_words_list")),
        )

    def _generate(self, request, sender):
        ids_tensor = pb_utils.get_input_tensor_by_name(request, "input_ids")
        lengths_tensor = pb_utils.get_input_tensor_by_name(request, "input_lengths")
        if ids_tensor is None or lengths_tensor is None:
            raise ValueError("input_ids and input_lengths are required")
        input_ids = ids_tensor.as_numpy()
        lengths = lengths_tensor.as_numpy().reshape(-1)
        if input_ids.shape[0] != 1:
            raise ValueError("send one prompt per request (batch size 1)")
        prompt = input_ids[0, : int(lengths[0])].astype(np.int64).tolist()
        s = self._sampling(request)
        budget = min(s.max_tokens, self.context_length - len(prompt))
        if budget < 1:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the {self.context_length}-token context")

        generator = torch.Generator().manual_seed(s.seed)
        generated: list[int] = []
        pending: list[int] = []
        past = None
        step_input = torch.tensor([prompt])
        with torch.inference_mode():
            for _ in range(budget):
                if self._cancelled(request, sender) or self._stopped(request):
                    pb_utils.Logger.log_info(f"llm_generator: {request.request_id()!r} stopped after {len(generated)} tokens")
                    break
                out = self.model(input_ids=step_input, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = self._next_token(out.logits[0, -1], prompt + generated, generated, s, generator)
                if token == s.end_id:
                    break
                generated.append(token)
                pending.append(token)
                if self._hits_stop_word(generated, s.stop_words):
                    break
                if s.stream and self._whole_characters(pending):
                    sender.send(self._response(pending))
                    pending = []
                step_input = torch.tensor([[token]])
        if pending or not s.stream:
            sender.send(self._response(pending), flags=FINAL)
        else:
            sender.send(flags=FINAL)

    @staticmethod
    def _cancelled(request, sender) -> bool:
        if hasattr(sender, "is_cancelled") and sender.is_cancelled():
            return True
        return hasattr(request, "is_cancelled") and request.is_cancelled()

    def _whole_characters(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return not text.endswith("\ufffd")

    @staticmethod
    def _hits_stop_word(generated: list[int], stop_words: list[list[int]]) -> bool:
        return any(len(w) <= len(generated) and generated[-len(w):] == w for w in stop_words)

    @staticmethod
    def _next_token(logits, context, generated, s: Sampling, generator) -> int:
        logits = logits.clone()
        if s.repetition_penalty != 1.0 and context:
            seen = torch.tensor(sorted(set(context)))
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty)
        for word in s.bad_words:
            if len(word) == 1 or generated[-(len(word) - 1):] == word[:-1]:
                logits[word[-1]] = float("-inf")
        if s.greedy:
            return int(torch.argmax(logits))
        logits = logits / s.temperature
        if s.top_k > 1:
            kth = torch.topk(logits, min(s.top_k, logits.numel())).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if 0 < s.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < s.top_p
            mask = torch.zeros_like(probs, dtype=torch.bool)
            mask[order[keep]] = True
            probs = torch.where(mask, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        return int(torch.multinomial(probs, 1, generator=generator))

    @staticmethod
    def _response(tokens: list[int]):
        ids = np.array([tokens], dtype=np.int32).reshape(1, -1)
        return pb_utils.InferenceResponse([pb_utils.Tensor("output_ids", ids)])
