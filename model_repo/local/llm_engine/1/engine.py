"""The generation engine behind llm_engine: in-flight batching of several sequences, one
token per sequence per step, with a block prefix KV cache.

A scheduler thread admits waiting sequences up to `max_active`, runs the context phase
(prefill, reusing cached prefix blocks) of newly admitted ones, then one decode step for
every sequence in generation, and removes the ones that ended, were cancelled or stopped.
Cancellation is seen within one step.

Two compute backends share the scheduler and the cache:
- HfBackend: a Hugging Face causal LM (torch); the KV of cached blocks is real.
- SyntheticBackend: no compute; prefill costs `prefill_us_per_token` for each token not
  served from the cache, a decode step `decode_us` for all sequences at once (as in-flight
  batching on a GPU), and the tokens are a seeded sequence of ordinary words ("words") or
  the prompt's own tokens again ("echo"). For measuring the gateway (streams, routing)
  without the CPU model being the limit, and for testing detokenization of any text."""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kv_blocks import BlockCache, block_keys


@dataclass
class Sampling:
    max_new: int
    end_id: int
    top_k: int = 0
    top_p: float = 0.0
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    seed: int = 0
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)

    @property
    def greedy(self) -> bool:
        # TensorRT-LLM's rule: no top_k above 1 and no top_p means greedy search.
        return self.temperature <= 0 or (self.top_k <= 1 and self.top_p <= 0)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: Sampling
    streaming: bool
    # Sends a list of new token ids (final=True for the last call); errors as text.
    send: Callable[[list[int], bool], None]
    fail: Callable[[str], None]
    cancelled: Callable[[], bool]
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    stop_requested: bool = False
    phase: str = "waiting"  # waiting, context, generation
    state: Any = None  # the backend's (KV cache, sampling generator)
    reused_blocks: int = 0
    prefilled: int = 0  # prompt tokens computed in the context phase (not from the cache)

    def hits_stop_word(self) -> bool:
        return any(len(w) <= len(self.generated) and self.generated[-len(w) :] == w for w in self.sampling.stop_words)

    def blocks(self, tokens_per_block: int) -> int:
        return -(-(len(self.prompt) + len(self.generated)) // tokens_per_block)


class Engine:
    def __init__(self, backend: Any, cache: BlockCache, *, max_active: int, on_step: Callable[[Engine], None]) -> None:
        self.backend = backend
        self.cache = cache
        self.max_active = max_active
        self.on_step = on_step
        self.waiting: deque[Sequence] = deque()
        self.active: list[Sequence] = []
        self.context_now = 0
        self.prefilled_total = 0  # prompt tokens computed (not served from the cache), ever
        self._stops: dict[str, float] = {}  # request id -> when a stop request came (it may come first)
        self._cond = threading.Condition()
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="llm-engine", daemon=True)
        self._thread.start()

    def submit(self, sequence: Sequence) -> None:
        with self._cond:
            if sequence.request_id and self._stops.pop(sequence.request_id, None) is not None:
                sequence.stop_requested = True
            self.waiting.append(sequence)
            self._cond.notify()

    def stop_request(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` input: end the running request with this id at its next step."""
        with self._cond:
            now = time.monotonic()
            self._stops = {rid: at for rid, at in self._stops.items() if now - at < 300}
            for sequence in [*self.active, *self.waiting]:
                if sequence.request_id == request_id:
                    sequence.stop_requested = True
                    return
            self._stops[request_id] = now

    def close(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify()
        self._thread.join(timeout=10)

    # -- the scheduler -------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._running and not self.waiting and not self.active:
                    self._cond.wait()
                if not self._running:
                    return
                admitted = []
                while self.waiting and len(self.active) < self.max_active:
                    sequence = self.waiting.popleft()
                    sequence.phase = "context"
                    self.active.append(sequence)
                    admitted.append(sequence)
            self.context_now = len(admitted)
            self.on_step(self)
            self._step(admitted)
            self.context_now = 0
            self.on_step(self)

    def _step(self, admitted: list[Sequence]) -> None:
        for sequence in list(self.active):
            if sequence.cancelled() or sequence.stop_requested:
                self._end(sequence)
        for sequence in [s for s in admitted if s in self.active]:
            try:
                token = self.backend.context(sequence, self.cache)
            except Exception as exc:  # one bad request must not stop the others
                self._fail(sequence, exc)
                continue
            sequence.phase = "generation"
            self.prefilled_total += sequence.prefilled
            self._take(sequence, token)
        decoding = [s for s in self.active if s.phase == "generation" and s not in admitted]
        if decoding:
            try:
                tokens = self.backend.decode(decoding)
            except Exception as exc:
                for sequence in decoding:
                    self._fail(sequence, exc)
                return
            for sequence, token in zip(decoding, tokens, strict=True):
                self._take(sequence, token)

    def _take(self, sequence: Sequence, token: int) -> None:
        if token == sequence.sampling.end_id:
            self._end(sequence)
            return
        sequence.generated.append(token)
        sequence.unsent.append(token)
        if sequence.hits_stop_word() or len(sequence.generated) >= sequence.sampling.max_new:
            self._end(sequence)
        elif sequence.streaming:
            tokens, sequence.unsent = sequence.unsent, []
            sequence.send(tokens, False)

    def _end(self, sequence: Sequence) -> None:
        if sequence in self.active:
            self.active.remove(sequence)
        tokens = sequence.generated if not sequence.streaming else sequence.unsent
        sequence.unsent = []
        sequence.state = None  # free the KV of a finished sequence at once
        try:
            sequence.send(tokens, True)
        except Exception:
            pass  # the client went away

    def _fail(self, sequence: Sequence, exc: Exception) -> None:
        if sequence in self.active:
            self.active.remove(sequence)
        sequence.state = None
        message = str(exc)
        if isinstance(exc, ValueError):
            message = f"invalid input: {exc}"
        try:
            sequence.fail(message)
        except Exception:
            pass


# -- compute backends -----------------------------------------------------------------------


class ContextWindow:
    """What both backends check of a prompt against their context length."""

    context_length: int

    def check(self, prompt: list[int], max_new: int) -> None:
        if len(prompt) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the {self.context_length}-token context")

    def budget(self, prompt: list[int], max_new: int) -> int:
        return min(max_new, self.context_length - len(prompt))


class HfBackend(ContextWindow):
    """A Hugging Face causal LM; each sequence keeps its own KV cache (DynamicCache)."""

    def __init__(self, model_dir: str, *, device: str = "cpu", dtype: str = "float32") -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.device = device
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device).eval()
        config = self.model.config
        self.context_length = int(
            getattr(config, "max_position_embeddings", 0) or getattr(config, "n_positions", 0) or 2048
        )

    def context(self, sequence: Sequence, cache: BlockCache) -> int:
        from transformers import DynamicCache

        torch = self.torch
        tpb = cache.tokens_per_block
        keys = block_keys(sequence.prompt, tpb)
        # Keep at least one prompt token to prefill: its logits give the first token.
        usable = keys[: (len(sequence.prompt) - 1) // tpb]
        blocks = cache.match(usable)
        sequence.reused_blocks = len(blocks)
        reused = len(blocks) * tpb
        sequence.prefilled = len(sequence.prompt) - reused
        past = None
        if blocks:
            layers = len(blocks[0])
            data = [
                (torch.cat([b[i][0] for b in blocks], dim=2), torch.cat([b[i][1] for b in blocks], dim=2))
                for i in range(layers)
            ]
            past = DynamicCache(data, config=self.model.config)
        with torch.inference_mode():
            ids = torch.tensor([sequence.prompt[reused:]], device=self.device)
            out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
        cache_now = out.past_key_values
        fresh = []
        for index in range(len(blocks), len(keys)):
            start, end = index * tpb, (index + 1) * tpb
            fresh.append(
                tuple(
                    (layer.keys[:, :, start:end].clone(), layer.values[:, :, start:end].clone())
                    for layer in cache_now.layers
                )
            )
        cache.insert(keys[len(blocks) :], fresh)
        generator = torch.Generator(device=self.device).manual_seed(sequence.sampling.seed)
        sequence.state = (cache_now, generator)
        return self._sample(out.logits[0, -1], sequence)

    def decode(self, sequences: list[Sequence]) -> list[int]:
        torch = self.torch
        tokens = []
        with torch.inference_mode():
            for sequence in sequences:
                past, _ = sequence.state
                ids = torch.tensor([[sequence.generated[-1]]], device=self.device)
                out = self.model(input_ids=ids, past_key_values=past, use_cache=True)
                sequence.state = (out.past_key_values, sequence.state[1])
                tokens.append(self._sample(out.logits[0, -1], sequence))
        return tokens

    def _sample(self, logits: Any, sequence: Sequence) -> int:
        torch = self.torch
        s = sequence.sampling
        logits = logits.float().clone()
        context = sequence.prompt + sequence.generated
        if s.repetition_penalty != 1.0 and context:
            seen = torch.tensor(sorted(set(context)), device=logits.device)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / s.repetition_penalty, values * s.repetition_penalty)
        generated = sequence.generated
        for word in s.bad_words:
            if len(word) == 1 or generated[-(len(word) - 1) :] == word[:-1]:
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
        return int(torch.multinomial(probs, 1, generator=sequence.state[1]))


class SyntheticBackend(ContextWindow):
    """No model: costs and tokens only (see the module docstring)."""

    def __init__(
        self, words: list[int], *, prefill_us_per_token: float, decode_us: float, context_length: int,
        echo: bool = False,
    ) -> None:
        self.words = words or list(range(100, 1100))
        self.echo = echo
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        self.decode_s = decode_us / 1e6
        self.context_length = context_length
        self._next_decode = 0.0

    def context(self, sequence: Sequence, cache: BlockCache) -> int:
        tpb = cache.tokens_per_block
        keys = block_keys(sequence.prompt, tpb)
        blocks = cache.match(keys[: (len(sequence.prompt) - 1) // tpb])
        sequence.reused_blocks = len(blocks)
        cache.insert(keys[len(blocks) :], [None] * (len(keys) - len(blocks)))
        sequence.prefilled = len(sequence.prompt) - len(blocks) * tpb
        time.sleep(sequence.prefilled * self.prefill_s_per_token)
        sequence.state = random.Random(hash((sequence.sampling.seed, tuple(sequence.prompt[-8:]))))
        return self._next(sequence)

    def decode(self, sequences: list[Sequence]) -> list[int]:
        # One step for all sequences, paced to decode_us (a GPU step of in-flight batching).
        now = time.monotonic()
        self._next_decode = max(self._next_decode + self.decode_s, now)
        time.sleep(max(0.0, self._next_decode - now))
        return [self._next(s) for s in sequences]

    def _next(self, sequence: Sequence) -> int:
        if self.echo:  # the prompt again, token by token, then the end
            done = len(sequence.generated)
            return sequence.prompt[done] if done < len(sequence.prompt) else sequence.sampling.end_id
        return sequence.state.choice(self.words)
