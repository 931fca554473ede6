"""The generation engine behind llm_engine: in-flight batching with a block prefix KV cache.

A scheduler thread repeats one step:
1. ends the sequences that were cancelled or stopped (so a cancel is seen within a step);
2. admits waiting sequences while fewer than `max_active` run and the KV budget holds them,
   and runs their context phase (prefill, reusing cached prefix blocks): one forward pass
   for all the sequences admitted together, each getting its first token;
3. runs ONE decode forward pass for every other sequence in generation, one token each;
4. ends the ones that produced their end id, a stop word or their last token (or whose
   guided-decoding grammar is complete), and merges the newly prefilled ones into the decode
   batch for the next step.

Per request, as TensorRT-LLM's engine offers them: an embedding bias, min_tokens (no end id
before), repetition, presence and frequency penalties, bad words (-inf), guided decoding (a
grammar masks the logits: guided.py), the log-probability of each generated token and its
raw logits (return_log_probs, return_generation_logits), and the raw logits of every prompt
position (return_context_logits: such a request reuses no cached prefix, so all of them are
computed). Log-probabilities are those of the model's own distribution: log-softmax of the
logits before bias, temperature, penalties, top-k/top-p and grammar masks.

Two compute backends share the scheduler and the cache:
- HfBackend: a Hugging Face causal LM (torch, CPU or CUDA); the KV of cached blocks is real.
  The sequences in generation share one padded KV cache (see HfBackend).
- SyntheticBackend: no compute; prefill costs `prefill_us_per_token` for each token not
  served from the cache, a decode step `decode_us` for all sequences at once (as in-flight
  batching on a GPU), and the tokens are a seeded sequence of ordinary words ("words") or
  the prompt's own tokens again ("echo"), or an agent's stand-in answer ("agent": model.py's
  agent_reply, a call of the first tool offered or a fixed sentence). A "words" request that asks for log
  probabilities, logits or a guide gets seeded random logits instead (so those features
  work at any context length without a model): the most likely token the guide allows. For measuring the gateway (streams, routing)
  without the CPU model being the limit, and for testing detokenization of any text."""

from __future__ import annotations

import inspect
import random
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kv_blocks import BlockCache, block_keys


@dataclass
class Sampling:
    max_new: int
    end_id: int
    top_k: int = 0
    top_p: float = 0.0
    # TensorRT-LLM's top-p decay: after each token top_p becomes max(top_p_min, top_p *
    # top_p_decay), back to its first value after the token top_p_reset_id.
    top_p_decay: float = 1.0
    top_p_min: float = 1e-6
    top_p_reset_id: int = -1
    temperature: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int = 0
    cache_salt_id: int = 0  # the prefix cache's salt (the gateway's: per tenant)
    stop_words: list[list[int]] = field(default_factory=list)
    bad_words: list[list[int]] = field(default_factory=list)
    log_probs: bool = False  # keep each generated token's log-probability
    generation_logits: bool = False  # keep each generated token's raw logits (a vocabulary row)
    context_logits: bool = False  # keep the raw logits of every prompt position (no prefix reuse)
    guide: Any = None  # a guided.Guide: the grammar the output must follow
    min_tokens: int = 0  # the end id is not generated before this many tokens
    embedding_bias: Any = None  # a vocabulary row (numpy) added to the logits, or None

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
    # Sends new token ids (final=True for the last call): always the last ones of `generated`
    # (all of them, when not streaming); errors as text.
    send: Callable[[list[int], bool], None]
    fail: Callable[[str], None]
    cancelled: Callable[[], bool]
    generated: list[int] = field(default_factory=list)
    unsent: list[int] = field(default_factory=list)
    stop_requested: bool = False
    phase: str = "waiting"  # waiting, context, generation
    state: Any = None  # the backend's per-sequence state (its sampling generator)
    reused_blocks: int = 0
    prefilled: int = 0  # prompt tokens computed in the context phase (not from the cache)
    # Aligned with `generated` when the sampling asks for them: log-probabilities, raw logits.
    logprobs: list[float] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    step: tuple[float, Any] | None = None  # the backend's (log-probability, logits) of the latest token
    context_logits: Any = None  # [prompt, vocabulary] raw logits, when the sampling asks for them
    scheduled_ns: int = 0  # time.time_ns() when the scheduler admitted it
    first_top_p: float = 0.0  # the top_p it came with (top-p decay resets to it)
    first_token_ns: int = 0  # time.time_ns() when its first token was made, and its latest
    last_token_ns: int = 0

    def hits_stop_word(self) -> bool:
        return any(len(w) <= len(self.generated) and self.generated[-len(w) :] == w for w in self.sampling.stop_words)

    def blocks(self, tokens_per_block: int) -> int:
        return -(-(len(self.prompt) + len(self.generated)) // tokens_per_block)

    @property
    def reserved(self) -> int:
        """The tokens of KV this sequence holds at most: its prompt and every new token."""
        return len(self.prompt) + self.sampling.max_new


class Engine:
    """kv_tokens: the KV budget in tokens, shared by the running sequences (counted as the
    padded batch they may grow to) and the prefix cache (which gives up blocks while they
    need them); None: no budget (the synthetic backend holds no KV)."""

    def __init__(
        self,
        backend: Any,
        cache: BlockCache,
        *,
        max_active: int,
        on_step: Callable[[Engine], None],
        kv_tokens: int | None = None,
        gate: Any = None,
    ) -> None:
        """gate: the responder's Gate (responder.py), closed while this thread runs a step."""
        self.backend = backend
        self.gate = gate
        self.cache = cache
        self.max_active = max_active
        self.kv_tokens = kv_tokens
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

    def submit(self, *sequences: Sequence) -> None:
        """Queue sequences (those of one request together: a stop that came first ends all)."""
        with self._cond:
            for sequence in sequences:
                if sequence.request_id and sequence.request_id in self._stops:
                    sequence.stop_requested = True
            for rid in {s.request_id for s in sequences}:
                self._stops.pop(rid, None)
            self.waiting.extend(sequences)
            self._cond.notify()

    def stop_request(self, request_id: str) -> None:
        """TensorRT-LLM's `stop` input: end the running sequences with this request id at
        their next step (every sequence of a batched request, or of num_return_sequences)."""
        with self._cond:
            now = time.monotonic()
            self._stops = {rid: at for rid, at in self._stops.items() if now - at < 300}
            matched = False
            for sequence in [*self.active, *self.waiting]:
                if sequence.request_id == request_id:
                    sequence.stop_requested = True
                    matched = True
            if not matched:
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
            with self.gate.closed() if self.gate is not None else nullcontext():
                self._iterate()

    def _iterate(self) -> None:
        """One step (see the module's docstring)."""
        self._end_stopped()  # (outside the lock: it sends responses)
        with self._cond:
            admitted = []
            while self.waiting and len(self.active) < self.max_active and self._fits(self.waiting[0]):
                sequence = self.waiting.popleft()
                sequence.phase = "context"
                sequence.scheduled_ns = time.time_ns()
                self.active.append(sequence)
                admitted.append(sequence)
        self._limit_prefix_cache()
        self.context_now = len(admitted)
        self.on_step(self)
        self._step(admitted)
        self.context_now = 0
        self.on_step(self)

    def _fits(self, sequence: Sequence) -> bool:
        """Whether the batch with this sequence stays in the KV budget at its longest (every
        row padded to the longest reservation). A sequence alone always runs."""
        if self.kv_tokens is None or not self.active:
            return True
        width = max(s.reserved for s in [*self.active, sequence])
        return (len(self.active) + 1) * width <= self.kv_tokens

    def _limit_prefix_cache(self) -> None:
        if self.kv_tokens is None:
            return
        width = max((s.reserved for s in self.active), default=0)
        batch_blocks = -(-(len(self.active) * width) // self.cache.tokens_per_block)
        self.cache.limit(self.cache.max_blocks - batch_blocks)

    def _end_stopped(self) -> None:
        for sequence in list(self.active):
            if sequence.cancelled() or sequence.stop_requested:
                self._end(sequence)

    def _step(self, admitted: list[Sequence]) -> None:
        fresh = []
        for sequence in admitted:
            if sequence.cancelled() or sequence.stop_requested:
                self._end(sequence)  # cancelled while it waited: it ends with no tokens
            else:
                fresh.append(sequence)
        if fresh:
            for sequence, result in zip(fresh, self._context(fresh), strict=True):
                if isinstance(result, Exception):
                    self._fail(sequence, result)
                    continue
                sequence.phase = "generation"
                self.prefilled_total += sequence.prefilled
                self._take(sequence, result)
        decoding = [s for s in self.active if s.phase == "generation" and s not in fresh]
        if decoding:
            try:
                tokens = self.backend.decode(decoding)
            except Exception as exc:
                for sequence in decoding:
                    self._fail(sequence, exc)
            else:
                for sequence, token in zip(decoding, tokens, strict=True):
                    self._take(sequence, token)
        # Frees the KV of the sequences that ended; the fresh ones join the decode batch.
        generating = [s for s in self.active if s.phase == "generation"]
        try:
            self.backend.retain(generating)
        except Exception as exc:  # (out of memory merging them, say): they cannot go on
            for sequence in generating:
                self._fail(sequence, exc)
            self.backend.retain([])

    def _context(self, sequences: list[Sequence]) -> list[int | Exception]:
        """The first token of each sequence; a sequence that fails alone fails alone."""
        try:
            return list(self.backend.context(sequences, self.cache))
        except Exception as exc:  # one bad request must not stop the others
            if len(sequences) == 1:
                return [exc]
        results: list[int | Exception] = []
        for sequence in sequences:
            results.extend(self._context([sequence]))
        return results

    def _take(self, sequence: Sequence, token: int) -> None:
        step, sequence.step = sequence.step, None
        if token == sequence.sampling.end_id:
            self._end(sequence)
            return
        sequence.generated.append(token)
        sequence.unsent.append(token)
        sequence.last_token_ns = time.time_ns()
        sequence.first_token_ns = sequence.first_token_ns or sequence.last_token_ns
        s = sequence.sampling
        if s.top_p_decay != 1.0 and s.top_p > 0:
            first = sequence.first_top_p = sequence.first_top_p or s.top_p
            s.top_p = first if token == s.top_p_reset_id else max(s.top_p_min, s.top_p * s.top_p_decay)
        if step is not None:
            if sequence.sampling.log_probs:
                sequence.logprobs.append(step[0])
            if sequence.sampling.generation_logits:
                sequence.logits.append(step[1])
        guide = sequence.sampling.guide
        if guide is not None:
            try:
                guide.consume(token)
            except ValueError as exc:  # (a token outside the grammar: bad words banned all it allowed)
                self._fail(sequence, RuntimeError(str(exc)))
                return
        if (
            sequence.hits_stop_word()
            or len(sequence.generated) >= sequence.sampling.max_new
            or (guide is not None and guide.done)
        ):
            self._end(sequence)
        elif sequence.streaming:
            tokens, sequence.unsent = sequence.unsent, []
            sequence.send(tokens, False)

    def _end(self, sequence: Sequence) -> None:
        if sequence in self.active:
            self.active.remove(sequence)
        tokens = sequence.generated if not sequence.streaming else sequence.unsent
        sequence.unsent = []
        sequence.state = None
        sequence.sampling.guide = None
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


# -- sizing ---------------------------------------------------------------------------------

CPU_MAX_ACTIVE = 8
CPU_KV_MEMORY = 1 << 30  # 1 GiB of KV on a CPU
CUDA_MAX_ACTIVE = 256
CUDA_KV_FRACTION = 0.8  # of the GPU memory free once the model is loaded
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '2GiB', '1.5G' -> bytes (binary units)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a size in bytes: {text!r}")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


@dataclass(frozen=True)
class Limits:
    max_active: int
    kv_blocks: int  # the KV budget, in blocks of tokens_per_block tokens


def size_limits(
    *,
    device: str,
    kv_bytes_per_token: int,
    tokens_per_block: int,
    context_length: int,
    max_active: str = "auto",
    kv_memory: str = "auto",
    kv_blocks: str = "auto",
    free_memory: int | None = None,
) -> Limits:
    """The in-flight batch's limits from the config's parameters; `auto` sizes them from the
    device. CUDA: the KV budget is CUDA_KV_FRACTION of the free GPU memory (`free_memory`,
    measured after loading the model), and as many sequences as that holds at
    min(context, 4096) tokens each, up to CUDA_MAX_ACTIVE. CPU: CPU_KV_MEMORY, CPU_MAX_ACTIVE.
    A number of kv_blocks overrides kv_memory."""
    if kv_blocks != "auto":
        blocks = int(kv_blocks)
    else:
        if kv_memory != "auto":
            memory = parse_bytes(kv_memory)
        elif device.startswith("cuda"):
            if free_memory is None:
                raise ValueError("free_memory is needed to size the KV budget on CUDA")
            memory = int(free_memory * CUDA_KV_FRACTION)
        else:
            memory = CPU_KV_MEMORY
        blocks = memory // (kv_bytes_per_token * tokens_per_block)
    if blocks < 1:
        raise ValueError(f"the KV budget holds no block of {tokens_per_block} tokens")
    if max_active != "auto":
        active = int(max_active)
    elif device.startswith("cuda"):
        per_sequence = min(context_length, 4096)
        active = max(1, min(CUDA_MAX_ACTIVE, blocks * tokens_per_block // per_sequence))
    else:
        active = CPU_MAX_ACTIVE
    if active < 1:
        raise ValueError("max_active_requests must be at least 1")
    return Limits(max_active=active, kv_blocks=blocks)


# -- compute backends -----------------------------------------------------------------------


class ContextWindow:
    """What both backends check of a prompt against their context length."""

    context_length: int

    def check(self, prompt: list[int], max_new: int) -> None:
        if len(prompt) >= self.context_length:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the {self.context_length}-token context")

    def budget(self, prompt: list[int], max_new: int) -> int:
        return min(max_new, self.context_length - len(prompt))


def _assign(layers: Any, tensors: list[tuple[Any, Any]]) -> None:
    """Every layer's keys and values at once (built beforehand, so no layer changes when
    building one fails)."""
    for layer, (keys, values) in zip(layers, tensors, strict=True):
        layer.keys, layer.values = keys, values


@dataclass
class _Rows:
    """Sequences and their KV in one padded cache: row i holds its `lengths[i]` tokens in
    the last columns of every layer's [rows, heads, width, head_dim] keys and values
    (left padding, masked out)."""

    sequences: list[Sequence]
    cache: Any  # a transformers DynamicCache
    lengths: list[int]

    @property
    def width(self) -> int:
        return int(self.cache.layers[0].keys.shape[-2])


class HfBackend(ContextWindow):
    """A Hugging Face causal LM with in-flight batching.

    The sequences in generation share one KV cache (a DynamicCache of [rows, heads, width,
    head_dim] tensors), each row's tokens right-aligned, so one decode step is one forward
    pass of all rows: an attention mask hides each row's left padding and explicit position
    ids give each row its own positions. Newly admitted sequences are prefilled together in
    one forward (their cached prefix blocks as past, their suffixes right-padded), then
    right-aligned and merged into the batch; ended ones are dropped from it, and columns no
    row uses any more are cut. Not for models with sliding-window attention (their masks
    count positions by cache column)."""

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
        # Only the last position's logits are needed (5.x causal LMs take logits_to_keep).
        self._logits_to_keep = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.batch: _Rows | None = None  # the sequences in generation
        self.pending: _Rows | None = None  # prefilled this step, merged into the batch by retain()
        self.forward_passes = 0
        self.kv_bytes_per_token = self._measure_kv_bytes()

    def _measure_kv_bytes(self) -> int:
        """Bytes of KV one token takes, from a one-token forward (also a warm-up)."""
        torch = self.torch
        with torch.inference_mode():
            out = self.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device), use_cache=True)
        return sum(
            layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
            for layer in out.past_key_values.layers
        )

    def _forward(self, **inputs: Any) -> Any:
        self.forward_passes += 1
        if self._logits_to_keep:
            inputs.setdefault("logits_to_keep", 1)
        return self.model(use_cache=True, **inputs)

    # Every tensor of the backend is made in inference mode (no autograd; in-place updates allowed).

    def context(self, sequences: list[Sequence], cache: BlockCache) -> list[int]:
        """Prefill `sequences` in one forward pass; their first tokens. Each reuses the
        longest run of its prompt's whole blocks found in `cache` and computes the rest."""
        with self.torch.inference_mode():
            return self._context(sequences, cache)

    def decode(self, sequences: list[Sequence]) -> list[int]:
        """One forward pass: the next token of every sequence (all in the batch)."""
        with self.torch.inference_mode():
            return self._decode(sequences)

    def retain(self, sequences: list[Sequence]) -> None:
        """Keep the KV of these sequences only; the ones prefilled this step join the batch."""
        with self.torch.inference_mode():
            self._keep(sequences, merge=True)

    # -- context phase ----------------------------------------------------------------

    def _context(self, sequences: list[Sequence], cache: BlockCache) -> list[int]:
        from transformers import DynamicCache

        torch = self.torch
        tpb = cache.tokens_per_block
        keys = [block_keys(s.prompt, tpb, s.sampling.cache_salt_id) for s in sequences]
        found = []
        for sequence, prompt_keys in zip(sequences, keys, strict=True):
            # Keep at least one prompt token to prefill: its logits give the first token. A
            # sequence that wants its context logits reuses nothing: every prompt position
            # is computed, so each has its logits.
            usable = 0 if sequence.sampling.context_logits else (len(sequence.prompt) - 1) // tpb
            blocks = cache.match(prompt_keys[:usable]) if usable else []
            sequence.reused_blocks = len(blocks)
            sequence.prefilled = len(sequence.prompt) - len(blocks) * tpb
            found.append(blocks)
        reused = [len(blocks) * tpb for blocks in found]
        suffixes = [s.prompt[r:] for s, r in zip(sequences, reused, strict=True)]
        n, past_width, width = len(sequences), max(reused), max(len(x) for x in suffixes)
        # Row i: [padding | its cached prefix] as past, then [its suffix | padding] as input.
        past = None
        if past_width:
            cached = self._past(found, past_width)
            past = DynamicCache([(layer[0], layer[1]) for layer in cached], config=self.model.config)
        ids = torch.tensor([x + [x[-1]] * (width - len(x)) for x in suffixes], device=self.device)
        starts = [past_width - r for r in reused]  # each row's first column
        columns = torch.arange(past_width + width, device=self.device)
        first = torch.tensor(starts, device=self.device)[:, None]
        ends = torch.tensor([past_width + len(x) for x in suffixes], device=self.device)[:, None]
        mask = ((columns >= first) & (columns < ends)).long()
        # Padding repeats the last position, which keeps learned position tables in range.
        positions = torch.tensor(
            [[r + min(j, len(x) - 1) for j in range(width)] for r, x in zip(reused, suffixes, strict=True)],
            device=self.device,
        )
        last = [len(x) - 1 for x in suffixes]
        keep = sorted(set(last))
        whole = any(s.sampling.context_logits for s in sequences)
        inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        if self._logits_to_keep:
            # 0: every position (context logits); else the last one, or each row's last.
            if whole:
                inputs["logits_to_keep"] = 0
            else:
                inputs["logits_to_keep"] = 1 if keep == [width - 1] else torch.tensor(keep, device=self.device)
        out = self._forward(past_key_values=past, **inputs)
        logits = out.logits  # [n, positions kept, vocab]
        if logits.shape[1] == width:  # every position (or a width of 1)
            picked = last
        elif logits.shape[1] == 1:  # the last one
            picked = [0] * n
        else:  # the positions in `keep`
            picked = [keep.index(i) for i in last]
        rows = logits[torch.arange(n, device=self.device), torch.tensor(picked, device=self.device)]
        # The first tokens, before anything lasting changes (the prefix cache, the batch):
        # a sequence that fails here is retried alone and must leave nothing behind.
        for sequence in sequences:  # (greedy rows draw nothing: no generator to make)
            if not sequence.sampling.greedy:
                sequence.state = torch.Generator(device=self.device).manual_seed(sequence.sampling.seed)
        tokens = self._sample(rows, sequences)
        for row, sequence in enumerate(sequences):
            if sequence.sampling.context_logits:  # (its whole prompt is its suffix: nothing reused)
                sequence.context_logits = logits[row, : len(sequence.prompt)].float().cpu().numpy()
        lengths = [len(s.prompt) for s in sequences]
        prefilled = self._right_align(out.past_key_values, starts, lengths)
        # A block's payload is one tensor [layers, 2 (keys, values), 1, heads, tokens, dim],
        # cut from every layer stacked once: one copy per block, not two per block and layer.
        stacked = None
        if any(len(prompt_keys) > len(blocks) for prompt_keys, blocks in zip(keys, found, strict=True)):
            stacked = torch.stack([torch.stack((layer.keys, layer.values)) for layer in prefilled.cache.layers])
        for row, (prompt_keys, blocks) in enumerate(zip(keys, found, strict=True)):
            offset = prefilled.width - lengths[row]
            fresh = [
                stacked[:, :, row : row + 1, :, offset + index * tpb : offset + (index + 1) * tpb].clone()
                for index in range(len(blocks), len(prompt_keys))
            ]
            cache.insert(prompt_keys[len(blocks) :], fresh)
        del stacked
        prefilled.sequences = list(sequences)
        self.pending = prefilled if self.pending is None else self._concat(self.pending, prefilled)
        return tokens

    def _past(self, found: list[list[Any]], width: int) -> Any:
        """Every layer's keys and values of the rows' cached blocks, [layers, 2 (keys,
        values), rows, heads, width, head_dim], each row's blocks in its last columns, zeros
        before them (one copy per row)."""
        sample = next(blocks for blocks in found if blocks)[0]  # [layers, 2, 1, heads, tokens, dim]
        layers, _, _, heads, tokens_per_block, dim = sample.shape
        tensor = sample.new_zeros((layers, 2, len(found), heads, width, dim))
        for row, blocks in enumerate(found):
            if blocks:
                tokens = len(blocks) * tokens_per_block
                tensor[:, :, row, :, width - tokens :] = self.torch.cat(blocks, dim=4)[:, :, 0]
        return tensor

    def _right_align(self, cache: Any, starts: list[int], lengths: list[int]) -> _Rows:
        """Rows whose tokens start at column starts[i] and run lengths[i] columns, moved so
        that each row's tokens end at the last column (one gather per tensor)."""
        torch = self.torch
        width = max(lengths)
        total = int(cache.layers[0].keys.shape[-2])
        if all(start == total - width for start in starts) and all(length == width for length in lengths):
            for layer in cache.layers:  # already aligned: cut the common padding
                layer.keys, layer.values = layer.keys[:, :, total - width :], layer.values[:, :, total - width :]
            return _Rows([], cache, lengths)
        # Column t of row i takes source column starts[i] + t - (width - lengths[i]);
        # columns before the row's tokens take column 0 (masked out).
        target = torch.arange(width, device=self.device)[None, :]
        shift = torch.tensor([s - (width - n) for s, n in zip(starts, lengths, strict=True)], device=self.device)
        source = (target + shift[:, None]).clamp(min=0)
        for layer in cache.layers:
            index = source[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys = layer.keys.gather(2, index)
            layer.values = layer.values.gather(2, index)
        return _Rows([], cache, lengths)

    # -- generation phase -------------------------------------------------------------

    def _decode(self, sequences: list[Sequence]) -> list[int]:
        torch = self.torch
        self._keep(sequences, merge=False)
        batch = self.batch
        if batch is None or len(batch.sequences) != len(sequences):
            raise RuntimeError("decode of sequences that are not in the batch")
        width = batch.width
        lengths = torch.tensor(batch.lengths, device=self.device)
        ids = torch.tensor([[s.generated[-1]] for s in batch.sequences], device=self.device)
        columns = torch.arange(width + 1, device=self.device)[None, :]
        mask = (columns >= (width - lengths)[:, None]).long()
        out = self._forward(
            input_ids=ids, attention_mask=mask, position_ids=lengths[:, None], past_key_values=batch.cache
        )
        batch.cache = out.past_key_values
        batch.lengths = [n + 1 for n in batch.lengths]
        tokens = self._sample(out.logits[:, -1], batch.sequences)
        by_sequence = dict(zip(map(id, batch.sequences), tokens, strict=True))
        return [by_sequence[id(s)] for s in sequences]

    def _keep(self, sequences: list[Sequence], *, merge: bool) -> None:
        wanted = {id(s) for s in sequences}
        parts = [self._select(self.batch, wanted)]
        if merge:
            parts.append(self._select(self.pending, wanted))
            self.pending = None
        rows = [part for part in parts if part is not None]
        if not rows:
            self.batch = None
        elif len(rows) == 1:
            self.batch = rows[0]
        else:
            self.batch = self._concat(rows[0], rows[1])

    def _select(self, rows: _Rows | None, wanted: set[int]) -> _Rows | None:
        """The rows of these sequences, cut to the width the longest of them needs."""
        if rows is None:
            return None
        keep = [i for i, s in enumerate(rows.sequences) if id(s) in wanted]
        if not keep:
            return None
        width, needed = rows.width, max(rows.lengths[i] for i in keep)
        if len(keep) == len(rows.sequences) and needed == width:
            return rows
        index = self.torch.tensor(keep, device=self.device)
        layers = rows.cache.layers
        cut = [
            (layer.keys[:, :, width - needed :].index_select(0, index),
             layer.values[:, :, width - needed :].index_select(0, index))
            for layer in layers
        ]
        _assign(layers, cut)
        return _Rows([rows.sequences[i] for i in keep], rows.cache, [rows.lengths[i] for i in keep])

    def _concat(self, first: _Rows, second: _Rows) -> _Rows:
        """Both sets of rows in one cache, the narrower padded on the left.

        Both paddings are measured before any layer changes: `width` reads the first layer,
        which the loop replaces (measured inside it, every layer after the first went
        unpadded, and a batch joined by a wider one failed with "Sizes of tensors must
        match"). Nothing is replaced until every layer is built, so a failure leaves both
        caches as they were."""
        functional = self.torch.nn.functional
        width = max(first.width, second.width)
        pad_first, pad_second = (0, 0, width - first.width, 0), (0, 0, width - second.width, 0)
        joined = [
            (self.torch.cat([functional.pad(mine.keys, pad_first), functional.pad(theirs.keys, pad_second)]),
             self.torch.cat([functional.pad(mine.values, pad_first), functional.pad(theirs.values, pad_second)]))
            for mine, theirs in zip(first.cache.layers, second.cache.layers, strict=True)
        ]
        _assign(first.cache.layers, joined)
        return _Rows(first.sequences + second.sequences, first.cache, first.lengths + second.lengths)

    # -- sampling ---------------------------------------------------------------------

    def _sample(self, logits: Any, sequences: list[Sequence]) -> list[int]:
        """The next token of each row of `logits` [rows, vocab], with each sequence's own
        sampling settings and generator (one host transfer for the whole batch). Sequences
        that keep log-probabilities or logits get them in `step`."""
        torch = self.torch
        kept = [i for i, s in enumerate(sequences) if s.sampling.log_probs or s.sampling.generation_logits]
        raw = logits[kept].float() if kept else None  # (indexing copies: the raw logits stay as they are)
        logits = logits.float()  # (changed in place: a copy of the model's output, or a view of it)
        self._penalize(logits, sequences)
        self._constrain(logits, sequences)
        chosen = torch.argmax(logits, dim=-1)
        sampled = [i for i, s in enumerate(sequences) if not s.sampling.greedy]
        if sampled:
            probs = self._probabilities(logits[sampled], [sequences[i].sampling for i in sampled])
            for j, i in enumerate(sampled):
                chosen[i] = torch.multinomial(probs[j], 1, generator=sequences[i].state)[0]
        tokens = [int(t) for t in chosen.tolist()]
        if raw is not None:
            logprobs = torch.log_softmax(raw, dim=-1)
            rows = torch.arange(len(kept), device=raw.device)
            picked = logprobs[rows, torch.tensor([tokens[i] for i in kept], device=raw.device)].tolist()
            wanted = any(sequences[i].sampling.generation_logits for i in kept)
            host = raw.cpu().numpy() if wanted else None
            for j, i in enumerate(kept):
                row = host[j] if host is not None and sequences[i].sampling.generation_logits else None
                sequences[i].step = (float(picked[j]), row)
        return tokens

    def _constrain(self, logits: Any, sequences: list[Sequence]) -> None:
        """Guided decoding: the tokens a row's grammar does not allow next get -inf."""
        for i, sequence in enumerate(sequences):
            guide = sequence.sampling.guide
            if guide is not None:
                allowed = self.torch.from_numpy(guide.mask()).to(logits.device)
                width = min(int(allowed.shape[0]), int(logits.shape[-1]))
                logits[i, :width].masked_fill_(~allowed[:width], float("-inf"))
                logits[i, width:] = float("-inf")

    def _penalize(self, logits: Any, sequences: list[Sequence]) -> None:
        """Repetition penalty on the tokens seen so far; presence and frequency penalties on
        the tokens generated so far (OpenAI's form: minus presence once, minus frequency per
        occurrence); bad words (-inf); per row. Before them, a row's embedding bias is added;
        until a row has min_tokens tokens, its end id is -inf."""
        torch = self.torch
        for i, sequence in enumerate(sequences):
            bias = sequence.sampling.embedding_bias
            if bias is not None:
                width = min(len(bias), int(logits.shape[-1]))
                logits[i, :width] += torch.from_numpy(bias[:width]).to(device=logits.device, dtype=logits.dtype)
        for i, sequence in enumerate(sequences):
            s = sequence.sampling
            if len(sequence.generated) < s.min_tokens and 0 <= s.end_id < logits.shape[-1]:
                logits[i, s.end_id] = float("-inf")
            if (s.presence_penalty or s.frequency_penalty) and sequence.generated:
                ids, counts = torch.unique(torch.tensor(sequence.generated, device=logits.device), return_counts=True)
                logits[i, ids] -= s.presence_penalty + s.frequency_penalty * counts.to(logits.dtype)
        rows = [i for i, s in enumerate(sequences) if s.sampling.repetition_penalty != 1.0]
        if rows:
            seen = [sorted(set(sequences[i].prompt + sequences[i].generated)) for i in rows]
            longest = max(len(ids) for ids in seen)
            # Short rows repeat their first id: gather and scatter of a repeated id agree.
            index = torch.tensor([ids + [ids[0]] * (longest - len(ids)) for ids in seen], device=logits.device)
            penalty = torch.tensor(
                [[sequences[i].sampling.repetition_penalty] for i in rows], device=logits.device, dtype=logits.dtype
            )
            row_index = torch.tensor(rows, device=logits.device)
            part = logits.index_select(0, row_index)
            values = part.gather(1, index)
            part.scatter_(1, index, torch.where(values > 0, values / penalty, values * penalty))
            logits.index_copy_(0, row_index, part)
        banned_rows, banned_tokens = [], []
        for i, sequence in enumerate(sequences):
            generated = sequence.generated
            for word in sequence.sampling.bad_words:
                if len(word) == 1 or generated[-(len(word) - 1) :] == word[:-1]:
                    banned_rows.append(i)
                    banned_tokens.append(word[-1])
        if banned_rows:
            logits[banned_rows, banned_tokens] = float("-inf")

    def _probabilities(self, logits: Any, settings: list[Sampling]) -> Any:
        """Temperature, then top-k, softmax, top-p (each row with its own values)."""
        torch = self.torch
        device = logits.device
        logits = logits / torch.tensor([[s.temperature] for s in settings], device=device, dtype=logits.dtype)
        ks = [min(s.top_k, logits.shape[-1]) if s.top_k > 1 else 0 for s in settings]
        if any(ks):
            top = torch.topk(logits, max(ks), dim=-1).values
            kth = top.gather(1, torch.tensor([[max(k, 1) - 1] for k in ks], device=device))
            kth[torch.tensor([k == 0 for k in ks], device=device)] = float("-inf")
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        nucleus = [i for i, s in enumerate(settings) if 0 < s.top_p < 1]
        if nucleus:
            part = probs[nucleus]
            sorted_probs, order = torch.sort(part, descending=True)
            top_p = torch.tensor([[settings[i].top_p] for i in nucleus], device=device, dtype=part.dtype)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < top_p
            mask = torch.zeros_like(part, dtype=torch.bool).scatter_(1, order, keep)
            part = torch.where(mask, part, torch.zeros_like(part))
            probs[nucleus] = part / part.sum(dim=-1, keepdim=True)
        return probs


class SyntheticBackend(ContextWindow):
    """No model: costs and tokens only (see the module docstring)."""

    def __init__(
        self, words: list[int], *, prefill_us_per_token: float, decode_us: float, context_length: int,
        echo: bool = False, vocab_size: int = 0, reply: Callable[[list[int]], list[int]] | None = None,
    ) -> None:
        self.words = words or list(range(100, 1100))
        self.echo = echo
        # "agent": the whole answer, made from the prompt at once (model.py's agent_reply).
        self.reply = reply
        # The width of the synthetic logits made for requests that ask for log probabilities,
        # logits or a guide (0: none can).
        self.vocab_size = vocab_size
        self._word_ids = np.array([w for w in self.words if w < vocab_size], dtype=np.int64)
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        self.decode_s = decode_us / 1e6
        self.context_length = context_length
        self._next_decode = 0.0

    def context(self, sequences: list[Sequence], cache: BlockCache) -> list[int]:
        tpb = cache.tokens_per_block
        tokens = []
        for sequence in sequences:
            keys = block_keys(sequence.prompt, tpb, sequence.sampling.cache_salt_id)
            blocks = cache.match(keys[: (len(sequence.prompt) - 1) // tpb])
            sequence.reused_blocks = len(blocks)
            cache.insert(keys[len(blocks) :], [None] * (len(keys) - len(blocks)))
            sequence.prefilled = len(sequence.prompt) - len(blocks) * tpb
            time.sleep(sequence.prefilled * self.prefill_s_per_token)
            if self.reply is not None:
                sequence.state = self.reply(sequence.prompt)
            else:
                sequence.state = random.Random(hash((sequence.sampling.seed, tuple(sequence.prompt[-8:]))))
            tokens.append(self._next(sequence))
        return tokens

    def decode(self, sequences: list[Sequence]) -> list[int]:
        # One step for all sequences, paced to decode_us (a GPU step of in-flight batching).
        now = time.monotonic()
        self._next_decode = max(self._next_decode + self.decode_s, now)
        time.sleep(max(0.0, self._next_decode - now))
        return [self._next(s) for s in sequences]

    def retain(self, sequences: list[Sequence]) -> None:
        pass  # no KV to free

    def _next(self, sequence: Sequence) -> int:
        if self.reply is not None:  # the answer made at the context phase, then the end
            done = len(sequence.generated)
            return sequence.state[done] if done < len(sequence.state) else sequence.sampling.end_id
        if self.echo:  # the prompt again, token by token, then the end
            done = len(sequence.generated)
            return sequence.prompt[done] if done < len(sequence.prompt) else sequence.sampling.end_id
        s = sequence.sampling
        if s.guide is None and not s.log_probs and not s.generation_logits:
            return sequence.state.choice(self.words)
        # Synthetic logits: seeded noise, the usual words a little likelier; the most likely
        # token the guide allows is chosen.
        rng = np.random.default_rng(sequence.state.getrandbits(64))
        logits = rng.standard_normal(self.vocab_size).astype(np.float32)
        logits[self._word_ids] += 2.0
        masked = logits.copy()
        if s.guide is not None:
            allowed = s.guide.mask()[: self.vocab_size]
            masked[: len(allowed)][~allowed] = -np.inf
            masked[len(allowed) :] = -np.inf
        token = int(np.argmax(masked))
        shifted = logits - logits.max()
        logprobs = shifted - np.log(np.exp(shifted).sum())
        sequence.step = (float(logprobs[token]), logits if s.generation_logits else None)
        return token
