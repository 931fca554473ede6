"""A decode step without per-step Python in the model: a static KV cache and CUDA graphs.

StaticBackend is HfBackend with another generation phase. The context phase is HfBackend's
(the Hugging Face model's forward, cached prefix blocks reused); the prompt's KV is then
copied into a static cache, and every decode step runs the model's layers, written out here
over that cache, on CUDA as a CUDA graph captured once per (rows, columns) bucket. Eager
HfBackend spends a 300M model's decode step in Python and kernel launches (10% of an H100
busy at 128 streams); a replayed graph runs the same kernels back to back.

- The static cache: per layer, keys and values of [rows, kv heads, columns, head dim]. A
  running sequence owns one row, its tokens in the first columns; the running sequences
  hold rows 0..n-1 (when some end, the ones after them move down).
- One step: each row's last token at its own position (the KV it holds); its key and value
  are written at that column, and attention reads the columns up to it (a mask made from
  the positions inside the step). It gives every row's logits and their argmax.
- Buckets: rows padded up to a power of two (padding rows compute at column 0 of rows no
  sequence holds: nothing reads them), columns up to the power of two (at least 64) above
  the longest row, so a step reads the KV the batch has, not the whole cache. A bucket's
  graph is captured at its first use, with the step's own inputs (the warm-up writes the
  same keys and values the replay writes); one whose capture fails runs eagerly.
- Launched ahead (`overlap`; model.py's `decode_ahead`, on by default: on an H100, 128
  streams of 512 tokens through Triton, 26,600-26,900 tokens/s against 19,200-23,000 without;
  docs/benchmarks.md): a greedy batch's next step is launched as
  soon as this step's tokens are read, before the engine takes them (ends sequences,
  queues responses), so the GPU runs while the engine's thread does the step's Python.
  The next decode takes its tokens if no row joined meanwhile (none is launched while a
  prefill waits to join); rows that ended are skipped (their extra KV is never read), and
  rows that move down take the extra column with them.
- Sampling: when every sequence of the batch decodes greedily with nothing to apply
  (penalties, bias, bad words, a guide, log probabilities, logits, min_tokens), the graph's
  argmax is the step's one host transfer; any other batch is sampled from the graph's
  logits by HfBackend._sample, per row, exactly as before.

Written out for GPT-2 and Llama-shaped models (the local profile's); `supports()` says
whether a model is one of them (model.py uses HfBackend for any other, and on the CPU)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from engine import HfBackend, Sequence

MIN_COLUMNS = 64


def supports(config: Any) -> bool:
    """Whether the decode step below is this model's forward pass."""
    kind = getattr(config, "model_type", "")
    if kind == "gpt2":
        return (
            getattr(config, "scale_attn_weights", True)
            and not getattr(config, "scale_attn_by_inverse_layer_idx", False)
            and not getattr(config, "reorder_and_upcast_attn", False)
            and getattr(config, "add_cross_attention", False) is False
        )
    if kind == "llama":
        return not getattr(config, "sliding_window", None) and not getattr(config, "attention_bias", False)
    return False


def plain(sequence: Sequence) -> bool:
    """Greedy with nothing to apply to the logits: the argmax of the model's own logits."""
    s = sequence.sampling
    return (
        s.greedy
        and s.repetition_penalty == 1.0
        and not s.presence_penalty
        and not s.frequency_penalty
        and s.embedding_bias is None
        and not s.bad_words
        and s.guide is None
        and not s.log_probs
        and not s.generation_logits
        and len(sequence.generated) >= s.min_tokens
    )


def bucket(size: int, smallest: int, largest: int) -> int:
    """The power of two (from `smallest`) that holds `size`, or `largest`."""
    found = smallest
    while found < size:
        found *= 2
    return min(found, largest)


class Ahead:
    """A step launched ahead: its rows (a sequence's id -> row) and their tokens, read once
    the GPU made them (`ready`: a CUDA event; None: made already)."""

    def __init__(self, sequences: list[Sequence], made: Any, ready: Any = None) -> None:
        self.sequences = list(sequences)  # (held: their ids are not reused while it lives)
        self.rows = {id(s): row for row, s in enumerate(sequences)}
        self.made = made
        self.ready = ready

    def tokens(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
            return [int(t) for t in self.made.tolist()]
        return list(self.made)


class StaticBackend(HfBackend):
    """HfBackend whose decode steps run over a static cache (see the module's docstring).
    `allocate` sizes the cache; until then it holds no rows. `graphs`: capture CUDA graphs
    (default: on CUDA)."""

    def __init__(
        self,
        model_dir: str,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        graphs: bool | None = None,
        overlap: bool = False,
    ) -> None:
        super().__init__(model_dir, device=device, dtype=dtype)
        config = self.model.config
        if not supports(config):
            raise ValueError(f"no static decode for {getattr(config, 'model_type', '?')} models")
        self.gpt2 = config.model_type == "gpt2"
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        width = int(config.hidden_size)
        self.head_dim = int(getattr(config, "head_dim", None) or width // self.heads)
        self.use_graphs = self.device.startswith("cuda") if graphs is None else graphs
        self.gate: Any = None  # the responder's Gate (responder.py): opened while a step waits on the GPU
        # Greedy batches launch their next step before the engine takes this one's tokens
        # (where the GPU runs while the step's Python does; default: off).
        self.overlap = overlap
        self.ahead: Ahead | None = None
        self.discarded_passes = 0  # steps launched ahead and run again (a row joined)
        self.host: Any = None  # (pinned, on CUDA) the tokens of a step launched ahead
        self.rows = 0
        self.columns = 0
        self.keys: list[Any] = []  # per layer; made by allocate()
        self.values: list[Any] = []
        self.ids: Any = None  # the step's inputs, [rows]: each row's last token and its position
        self.positions: Any = None
        self.index: Any = None  # 0, 1, 2, ...: row numbers and column numbers
        self.running: list[Sequence] = []  # row i's sequence
        self.lengths: list[int] = []  # the KV tokens row i holds
        self.captured: dict[tuple[int, int], tuple[Any, Any] | None] = {}  # None: capture failed, eager
        self.pool: Any = None

    def allocate(self, max_rows: int, budget_tokens: int, *, max_columns: int = 4096) -> int:
        """Make the static cache: columns for the longest sequence the context holds (at most
        max_columns: the context length becomes that), and as many rows as half the KV
        budget holds (the rest is the prefix cache's), up to max_rows, at least one. The rows
        made; they bound the sequences that run at once."""
        torch = self.torch
        self.columns = min(self.context_length, max_columns)
        self.context_length = self.columns  # (ContextWindow checks a sequence fits in its row)
        self.rows = max(1, min(max_rows, budget_tokens // 2 // self.columns))
        layers = len(self.model.transformer.h) if self.gpt2 else len(self.model.model.layers)
        dtype = self.model.dtype
        shape = (self.rows, self.kv_heads, self.columns, self.head_dim)
        with torch.inference_mode():
            self.keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
            self.values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
            self.ids = torch.zeros(self.rows, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(self.rows, dtype=torch.long, device=self.device)
            self.index = torch.arange(max(self.rows, self.columns), device=self.device)
            if self.device.startswith("cuda"):
                self.host = torch.zeros(self.rows, dtype=torch.long, pin_memory=True)
        if self.use_graphs:
            self.pool = torch.cuda.graph_pool_handle()
        return self.rows

    @property
    def static_tokens(self) -> int:
        return self.rows * self.columns

    # -- the generation phase ---------------------------------------------------------

    def decode(self, sequences: list[Sequence]) -> list[int]:
        torch = self.torch
        with torch.inference_mode():
            self._hold(sequences)
            if len(self.running) != len(sequences):
                raise RuntimeError("decode of sequences that are not in the batch")
            ahead, self.ahead = self.ahead, None
            greedy = all(plain(s) for s in self.running)
            if ahead is not None and all(id(s) in ahead.rows for s in self.running):
                with self.gate.opened() if self.gate is not None else nullcontext():
                    made = ahead.tokens()  # (the step's one wait for the GPU)
                tokens = [made[ahead.rows[id(s)]] for s in self.running]
                self.lengths = [length + 1 for length in self.lengths]
                self.forward_passes += 1
            else:
                if ahead is not None:  # (a row joined: the step runs again, writing the same KV)
                    self.discarded_passes += 1
                logits, argmax = self._launch([s.generated[-1] for s in self.running])
                self.lengths = [length + 1 for length in self.lengths]
                self.forward_passes += 1
                if greedy:
                    with self.gate.opened() if self.gate is not None else nullcontext():
                        chosen = argmax[: len(self.running)].tolist()  # (the step's one wait for the GPU)
                    tokens = [int(t) for t in chosen]
                else:
                    tokens = self._sample(logits[: len(self.running)], self.running)
            if greedy and self.overlap and self.pending is None:
                self.ahead = self._ahead(tokens)
            by_sequence = dict(zip(map(id, self.running), tokens, strict=True))
            return [by_sequence[id(s)] for s in sequences]

    def _launch(self, last: list[int]) -> tuple[Any, Any]:
        """Run one step for the running rows, `last` their latest tokens, each written at its
        row's length (the caller counts it); (logits, argmax)."""
        torch = self.torch
        n = len(self.running)
        staged = torch.tensor([*last, *self.lengths], dtype=torch.long)
        rows = bucket(n, 1, self.rows)
        columns = bucket(max(self.lengths) + 1, MIN_COLUMNS, self.columns)
        self.ids[:n].copy_(staged[:n])
        self.positions[:n].copy_(staged[n:])
        self.positions[n:rows].zero_()
        return self._run(rows, columns)

    def _ahead(self, tokens: list[int]) -> Ahead:
        """The next step, launched before the engine takes this one's tokens: the GPU runs it
        while the engine's thread does the step's Python. Its rows' tokens are valid for the
        next decode if no row joined (a row that ended is skipped, and its row's new KV is
        never read); otherwise the step runs again and writes the same KV."""
        _, argmax = self._launch(tokens)  # (its column is counted when it is taken)
        n = len(self.running)
        if not self.device.startswith("cuda"):
            return Ahead(self.running, argmax[:n].tolist())
        host = self.host[:n]
        host.copy_(argmax[:n], non_blocking=True)
        ready = self.torch.cuda.Event()
        ready.record()
        return Ahead(self.running, host, ready)

    def retain(self, sequences: list[Sequence]) -> None:
        """Keep these sequences' rows; the ones prefilled this step take the next rows."""
        with self.torch.inference_mode():
            self._hold(sequences)
            pending, self.pending = self.pending, None
            if pending is not None:
                self.ahead = None  # (none was launched with a prefill pending; never one across a join)
                wanted = {id(s) for s in sequences}
                self._admit(pending, [i for i, s in enumerate(pending.sequences) if id(s) in wanted])

    def _hold(self, sequences: list[Sequence]) -> None:
        """Drop the rows of the sequences not in `sequences`; the rows after them move down."""
        wanted = {id(s) for s in sequences}
        kept = [i for i, s in enumerate(self.running) if id(s) in wanted]
        if len(kept) == len(self.running):
            return
        moved = [(row, source) for row, source in enumerate(kept) if row != source]
        if moved:
            torch = self.torch
            target = torch.tensor([row for row, _ in moved], device=self.device)
            source = torch.tensor([source for _, source in moved], device=self.device)
            # (a step launched ahead wrote one column more)
            width = max(self.lengths[s] for _, s in moved) + (1 if self.ahead is not None else 0)
            for tensor in (*self.keys, *self.values):
                part = tensor[:, :, :width]
                part.index_copy_(0, target, part.index_select(0, source))
        self.running = [self.running[i] for i in kept]
        self.lengths = [self.lengths[i] for i in kept]

    def _admit(self, pending: Any, picked: list[int]) -> None:
        """Copy the KV of pending rows `picked` (right-aligned in HfBackend's prefill cache)
        into the next free rows, left-aligned."""
        if not picked:
            return
        torch = self.torch
        first, count = len(self.running), len(picked)
        if first + count > self.rows:
            raise RuntimeError(f"{first + count} sequences at once, the static cache has {self.rows} rows")
        lengths = [pending.lengths[i] for i in picked]
        width, longest = pending.width, max(lengths)
        select = torch.tensor(picked, device=self.device)
        # Column t of new row j is column (width - lengths[j]) + t of its prefill row.
        shift = torch.tensor([width - n for n in lengths], device=self.device)
        source = (self.index[:longest][None, :] + shift[:, None]).clamp(max=width - 1)
        index = source[:, None, :, None].expand(count, self.kv_heads, longest, self.head_dim)
        for layer, keys, values in zip(pending.cache.layers, self.keys, self.values, strict=True):
            keys[first : first + count, :, :longest].copy_(layer.keys.index_select(0, select).gather(2, index))
            values[first : first + count, :, :longest].copy_(layer.values.index_select(0, select).gather(2, index))
        self.running.extend(pending.sequences[i] for i in picked)
        self.lengths.extend(lengths)

    # -- the step ---------------------------------------------------------------------

    def _run(self, rows: int, columns: int) -> tuple[Any, Any]:
        if not self.use_graphs:
            return self._step(rows, columns)
        key = (rows, columns)
        if key not in self.captured:
            self.captured[key] = self._capture(rows, columns)
        found = self.captured[key]
        if found is None:
            return self._step(rows, columns)
        graph, outputs = found
        graph.replay()
        return outputs

    def _capture(self, rows: int, columns: int) -> tuple[Any, Any] | None:
        """The bucket's graph, captured with the inputs of the step that first needs it:
        the warm-up runs that step (a step rewrites the same keys and values when run
        again), and the caller replays the graph for its result."""
        torch = self.torch
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._step(rows, columns)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                outputs = self._step(rows, columns)
        except Exception as exc:  # an operation capture does not allow: this bucket stays eager
            print(f"static_decode: bucket {rows}x{columns} runs eagerly: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.synchronize()
            return None
        return graph, outputs

    def _step(self, rows: int, columns: int) -> tuple[Any, Any]:
        """One token for rows [0, rows) from self.ids at self.positions; (logits, argmax)."""
        ids, positions = self.ids[:rows], self.positions[:rows]
        # Row i attends to columns 0..positions[i] (its own new key included).
        mask = (self.index[:columns][None, :] <= positions[:, None])[:, None, None, :]
        hidden = self._gpt2(ids, positions, mask, columns) if self.gpt2 else self._llama(ids, positions, mask, columns)
        logits = self.model.lm_head(hidden)
        return logits, logits.argmax(dim=-1)

    def _attend(self, layer: int, q: Any, k: Any, v: Any, positions: Any, mask: Any, columns: int) -> Any:
        """Write this step's key and value at each row's position; attention over its columns.
        q: [rows, heads, 1, dim]; k, v: [rows, kv heads, dim]. Returns [rows, heads * dim]."""
        rows = q.shape[0]
        index = self.index[:rows]
        self.keys[layer][index, :, positions] = k
        self.values[layer][index, :, positions] = v
        out = self.torch.nn.functional.scaled_dot_product_attention(
            q,
            self.keys[layer][:rows, :, :columns],
            self.values[layer][:rows, :, :columns],
            attn_mask=mask,
            enable_gqa=self.kv_heads != self.heads,
        )
        return out.reshape(rows, self.heads * self.head_dim)

    def _gpt2(self, ids: Any, positions: Any, mask: Any, columns: int) -> Any:
        model = self.model.transformer
        rows, heads, dim = ids.shape[0], self.heads, self.head_dim
        hidden = model.wte(ids) + model.wpe(positions)  # [rows, width]
        for layer, block in enumerate(model.h):
            q, k, v = block.attn.c_attn(block.ln_1(hidden)).split(heads * dim, dim=1)
            attended = self._attend(
                layer, q.view(rows, heads, 1, dim), k.view(rows, heads, dim), v.view(rows, heads, dim),
                positions, mask, columns,
            )  # fmt: skip
            hidden = hidden + block.attn.c_proj(attended)
            hidden = hidden + block.mlp(block.ln_2(hidden))
        return model.ln_f(hidden)

    def _llama(self, ids: Any, positions: Any, mask: Any, columns: int) -> Any:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        model = self.model.model
        rows, dim = ids.shape[0], self.head_dim
        hidden = model.embed_tokens(ids)  # [rows, width]
        cos, sin = model.rotary_emb(hidden[:, None, :], positions[:, None])  # [rows, 1, dim]
        for layer, block in enumerate(model.layers):
            attention = block.self_attn
            x = block.input_layernorm(hidden)
            q = attention.q_proj(x).view(rows, self.heads, 1, dim)
            k = attention.k_proj(x).view(rows, self.kv_heads, 1, dim)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            v = attention.v_proj(x).view(rows, self.kv_heads, dim)
            attended = self._attend(layer, q, k.view(rows, self.kv_heads, dim), v, positions, mask, columns)
            hidden = hidden + attention.o_proj(attended)
            hidden = hidden + block.mlp(block.post_attention_layernorm(hidden))
        return model.norm(hidden)
