"""The llm_engine's in-flight batching, run directly (no Triton): the engine module is
imported the way model.py imports it, from its folder on sys.path, with tiny random
models built offline (a GPT-2 and a Llama shaped like SmolLM2: grouped-query attention,
rotary positions, tied embeddings)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from gateway.stack.weights import build_tiny_gpt2

ENGINE_DIR = Path(__file__).resolve().parents[1] / "model_repo" / "local" / "llm_engine" / "1"
sys.path.insert(0, str(ENGINE_DIR))

import engine as llm  # noqa: E402
import static_decode  # noqa: E402
from kv_blocks import BlockCache  # noqa: E402
from responder import Gate  # noqa: E402

WAIT_S = 120  # a generous bound on waiting for a condition, never a pace
PROMPTS = [
    [5, 17, 33, 2, 91, 40, 7],
    [120, 3, 3, 250, 61],
    [8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19],
    [300, 44],
    [77, 78, 12, 5, 5, 5, 200, 201, 202],
    [1, 2, 3],
    [150, 151, 160, 170, 180, 190, 199, 211, 222, 233, 244],
    [64, 32, 16, 8],
]


def save_tiny_llama(path: Path, **overrides: Any) -> Path:
    """A random Llama shaped like SmolLM2 (grouped-query attention, rotary positions, tied
    embeddings), tiny."""
    config = LlamaConfig(
        vocab_size=400,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        **overrides,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-models")
    return {"gpt2": build_tiny_gpt2(root / "tiny-gpt2"), "llama": save_tiny_llama(root / "tiny-llama")}


@dataclass
class Handle:
    """One request: its streamed tokens, and the backend's forward-pass count when it ended."""

    clock: Callable[[], int]
    tokens: list[int] = field(default_factory=list)
    error: str | None = None
    cancel: bool = False
    ended_at: int = -1
    done: threading.Event = field(default_factory=threading.Event)
    progress: threading.Condition = field(default_factory=threading.Condition)

    def send(self, tokens: list[int], final: bool) -> None:
        with self.progress:
            self.tokens.extend(tokens)
            self.progress.notify_all()
        if final:
            self.ended_at = self.clock()
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()

    def wait(self) -> list[int]:
        assert self.done.wait(WAIT_S), "the sequence did not end"
        assert self.error is None, self.error
        return self.tokens

    def wait_for_tokens(self, count: int) -> None:
        with self.progress:
            assert self.progress.wait_for(lambda: len(self.tokens) >= count or self.done.is_set(), WAIT_S)
        assert len(self.tokens) >= count


class Runner:
    """An engine on an HfBackend, and a way to submit prompts to it."""

    def __init__(self, backend: Any, *, max_active: int = 8, kv_tokens: int | None = 1 << 20, gate: Any = None) -> None:
        self.backend = backend
        self.cache = BlockCache(32, 4096)
        self.active_seen: list[int] = []
        self.gate_open_at_steps: list[bool] = []
        self.engine = llm.Engine(
            backend, self.cache, max_active=max_active, kv_tokens=kv_tokens, on_step=self._on_step, gate=gate
        )

    def _on_step(self, engine: Any) -> None:
        self.active_seen.append(len(engine.active))
        if engine.gate is not None:
            self.gate_open_at_steps.append(engine.gate.is_open)

    def submit(self, prompt: list[int], *, request_id: str = "", streaming: bool = True, **sampling: Any) -> Handle:
        handle = Handle(clock=lambda: self.backend.forward_passes)
        settings = {"max_new": 24, "end_id": -1, **sampling}
        self.engine.submit(
            llm.Sequence(
                request_id=request_id,
                prompt=list(prompt),
                sampling=llm.Sampling(**settings),
                streaming=streaming,
                send=handle.send,
                fail=handle.fail,
                cancelled=lambda: handle.cancel,
            )
        )
        return handle

    def run(self, prompts: list[list[int]], **sampling: Any) -> list[list[int]]:
        """All prompts submitted at once; their outputs."""
        handles = [self.submit(p, **sampling) for p in prompts]
        return [h.wait() for h in handles]

    def close(self) -> None:
        self.engine.close()


@pytest.fixture(params=["gpt2", "llama", "gpt2-static", "llama-static", "gpt2-static-ahead", "llama-static-ahead"])
def backend(request: pytest.FixtureRequest, model_dirs: dict[str, Path]) -> Any:
    """Each model on HfBackend, and on StaticBackend (its decode step over a static cache,
    eager here: the same code a CUDA graph captures on a GPU), with and without launching
    a greedy batch's next step before its tokens are taken (as on CUDA)."""
    kind, _, static = request.param.partition("-")
    if not static:
        return llm.HfBackend(str(model_dirs[kind]))
    backend = static_decode.StaticBackend(str(model_dirs[kind]), overlap=static.endswith("ahead"))
    backend.allocate(8, 1 << 20)
    return backend


@pytest.fixture
def runner(backend: Any) -> Iterator[Runner]:
    runner = Runner(backend)
    yield runner
    runner.close()


def alone(backend: Any, prompt: list[int], **sampling: Any) -> list[int]:
    """The output of one request with nothing else running (max_active 1). Called while no
    other engine on this backend has work: a backend serves one engine."""
    one = Runner(backend, max_active=1)
    try:
        return one.run([prompt], **sampling)[0]
    finally:
        one.close()


def test_batched_greedy_output_equals_one_at_a_time_output(backend: Any, runner: Runner) -> None:
    batched = runner.run(PROMPTS, max_new=32)
    one_at_a_time = Runner(backend, max_active=1)
    try:
        assert one_at_a_time.run(PROMPTS, max_new=32) == batched
    finally:
        one_at_a_time.close()
    assert max(runner.active_seen) > 1  # they did run together


def test_greedy_output_is_the_models_greedy_decoding(backend: Any, runner: Runner) -> None:
    batched = runner.run(PROMPTS, max_new=20)
    for prompt, output in zip(PROMPTS, batched, strict=True):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(20):  # the whole sequence again at each step, no cache, no batch
                ids.append(int(backend.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
        assert output == ids[len(prompt) :]


def test_eight_concurrent_sequences_take_one_forward_pass_per_step(backend: Any, runner: Runner) -> None:
    before = backend.forward_passes
    runner.run(PROMPTS[:1], max_new=48)
    one = backend.forward_passes - before  # a prefill, then a decode step per token after the first
    assert one == 48
    before = backend.forward_passes
    outputs = runner.run(PROMPTS, max_new=48)
    eight = backend.forward_passes - before
    assert all(len(tokens) == 48 for tokens in outputs)
    # 47 decode steps for all of them together, and at most one prefill per sequence
    # (fewer when they arrive together): far from the 8 x 48 of one pass per sequence.
    assert eight <= one + len(PROMPTS)
    assert eight < 3 * one


def test_a_sequence_admitted_mid_generation_gets_its_tokens(backend: Any, runner: Runner) -> None:
    expected = [alone(backend, PROMPTS[0], max_new=60), alone(backend, PROMPTS[1], max_new=12)]
    first = runner.submit(PROMPTS[0], max_new=60)
    first.wait_for_tokens(10)
    second = runner.submit(PROMPTS[1], max_new=12)
    assert second.wait() == expected[1]
    assert first.wait() == expected[0]
    assert max(runner.active_seen) == 2


def test_a_longer_prompt_joins_a_running_batch_narrower_than_itself(backend: Any, runner: Runner) -> None:
    # The running batch is padded on the left to the newcomer's width. (That padding was
    # measured again after the batch's first layer had been replaced, so its other layers
    # went unpadded and the step failed: "Sizes of tensors must match except in dimension 0".)
    short, longer = PROMPTS[3], PROMPTS[2]  # 2 and 12 tokens
    expected = [alone(backend, short, max_new=40), alone(backend, longer, max_new=12)]
    first = runner.submit(short, max_new=40)
    with first.progress:  # the engine waits to send its next token: the batch stays narrow
        assert first.progress.wait_for(lambda: len(first.tokens) >= 3, WAIT_S)
        second = runner.submit(longer, max_new=12)
    assert second.wait() == expected[1]
    assert first.wait() == expected[0]
    assert max(runner.active_seen) == 2


def test_a_sequence_failing_in_a_shared_context_step_fails_alone(backend: Any, runner: Runner) -> None:
    # Prefilled together, one of them fails (a bad word past the vocabulary); the others are
    # prefilled again one by one and must run on as if it had never come.
    expected = [alone(backend, p, max_new=10) for p in PROMPTS[:3]]
    with runner.engine._cond:  # (reentrant) all four are admitted in one step
        handles = [runner.submit(p, max_new=10) for p in PROMPTS[:3]]
        doomed = runner.submit(PROMPTS[3], max_new=10, bad_words=[[10**6]])
    assert [h.wait() for h in handles] == expected
    assert doomed.done.wait(WAIT_S)
    assert doomed.error


def test_cancel_ends_a_sequence_within_a_step_while_the_others_continue(backend: Any, runner: Runner) -> None:
    expected = [alone(backend, PROMPTS[0], max_new=120), alone(backend, PROMPTS[2], max_new=120)]
    handles = [runner.submit(p, max_new=120) for p in PROMPTS[:3]]
    for handle in handles:
        handle.wait_for_tokens(3)
    victim = handles[1]
    with victim.progress:  # no token is sent while the flag is set
        victim.cancel = True
        passes_at_cancel = backend.forward_passes
    assert victim.done.wait(WAIT_S)
    # Seen at the start of the next step: at most the step already running finishes.
    assert victim.ended_at - passes_at_cancel <= 1
    assert len(victim.tokens) < 120
    assert [handles[0].wait(), handles[2].wait()] == expected


def test_a_stop_request_ends_its_sequence_within_a_step(backend: Any, runner: Runner) -> None:
    expected = alone(backend, PROMPTS[0], max_new=100)
    other = runner.submit(PROMPTS[0], max_new=100)
    target = runner.submit(PROMPTS[1], max_new=100, request_id="req-7")
    target.wait_for_tokens(3)
    with target.progress:
        runner.engine.stop_request("req-7")
        passes_at_stop = backend.forward_passes
    assert target.done.wait(WAIT_S)
    assert target.ended_at - passes_at_stop <= 1
    assert len(target.tokens) < 100
    assert other.wait() == expected


def test_a_stop_word_ends_a_sequence_right_after_it(backend: Any, runner: Runner) -> None:
    expected = alone(backend, PROMPTS[2], max_new=30)
    stop_word = expected[6:8]
    end = next(i for i in range(len(expected) - 1) if expected[i : i + 2] == stop_word) + 2
    others = [runner.submit(p, max_new=30) for p in PROMPTS[3:6]]
    stopped = runner.submit(PROMPTS[2], max_new=30, stop_words=[stop_word])
    assert stopped.wait() == expected[:end]
    assert all(len(h.wait()) == 30 for h in others)


def test_max_tokens_ends_a_sequence(runner: Runner) -> None:
    short = runner.submit(PROMPTS[0], max_new=3)
    longer = runner.submit(PROMPTS[1], max_new=17)
    one = runner.submit(PROMPTS[2], max_new=1)
    assert [len(short.wait()), len(longer.wait()), len(one.wait())] == [3, 17, 1]


def test_the_end_id_ends_a_sequence_without_being_sent(backend: Any, runner: Runner) -> None:
    expected = alone(backend, PROMPTS[4], max_new=30)
    end_id = expected[5]
    cut = expected.index(end_id)
    assert runner.run([PROMPTS[4]], max_new=30, end_id=end_id)[0] == expected[:cut]


def test_a_bad_word_is_never_generated(backend: Any, runner: Runner) -> None:
    expected = alone(backend, PROMPTS[3], max_new=20)
    banned = expected[0]
    output = runner.run([PROMPTS[3]], max_new=20, bad_words=[[banned]])[0]
    assert banned not in output and len(output) == 20


def test_per_request_sampling_in_a_batch_is_what_it_is_alone(backend: Any, runner: Runner) -> None:
    settings: list[dict[str, Any]] = [
        {"top_k": 20, "temperature": 0.8, "seed": 1},
        {"top_p": 0.9, "seed": 2},
        {"top_k": 50, "top_p": 0.5, "temperature": 1.3, "seed": 3},
        {"repetition_penalty": 1.5},
        {"repetition_penalty": 0.7, "top_k": 5, "seed": 4},
        {},
    ]
    expected = [alone(backend, p, max_new=24, **s) for p, s in zip(PROMPTS, settings, strict=False)]
    handles = [runner.submit(p, max_new=24, **s) for p, s in zip(PROMPTS, settings, strict=False)]
    batched = [h.wait() for h in handles]
    assert batched == expected
    # A seed gives its sequence; another seed another one.
    assert runner.run([PROMPTS[0]], max_new=24, top_k=20, temperature=0.8, seed=1)[0] == batched[0]
    assert runner.run([PROMPTS[0]], max_new=24, top_k=20, temperature=0.8, seed=99)[0] != batched[0]


def test_prefix_cache_reuse_counts_reused_blocks_and_keeps_the_output(backend: Any) -> None:
    system = [(7 * i) % 390 + 5 for i in range(80)]  # two whole blocks of 32, and 16 more
    first, second = [*system, 11, 12], [*system, 300, 301, 302, 303]
    expected = [alone(backend, first, max_new=16), alone(backend, second, max_new=16)]
    runner = Runner(backend)
    try:
        assert runner.run([first], max_new=16)[0] == expected[0]
        assert runner.cache.reused_total == 0
        assert runner.engine.prefilled_total == len(first)
        # The second shares 80 tokens: two whole blocks come from the cache.
        assert runner.run([second], max_new=16)[0] == expected[1]
        assert runner.cache.reused_total == 2
        assert runner.engine.prefilled_total == len(first) + len(second) - 64
    finally:
        runner.close()


def test_sequences_prefilled_together_with_and_without_cached_prefixes(backend: Any) -> None:
    system = [(11 * i) % 390 + 5 for i in range(70)]
    prompts = [[*system, 40, 41], [9, 8, 7], [*system, 50], [*system[:33], 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]
    expected = [alone(backend, p, max_new=20) for p in prompts]
    runner = Runner(backend)
    try:
        runner.run([[*system, 60]], max_new=2)  # puts the system prompt's blocks in the cache
        with runner.engine._cond:  # (reentrant) all four are admitted in one step
            handles = [runner.submit(p, max_new=20) for p in prompts]
        assert [h.wait() for h in handles] == expected
        assert runner.cache.reused_total == 2 + 2 + 1
    finally:
        runner.close()


def test_the_kv_budget_limits_the_sequences_running_at_once(backend: Any) -> None:
    # Each sequence reserves its prompt and max_new tokens; the batch is counted padded.
    runner = Runner(backend, max_active=8, kv_tokens=2 * (12 + 20))
    try:
        outputs = runner.run(PROMPTS[:6], max_new=20)
        assert [len(t) for t in outputs] == [20] * 6
        assert max(runner.active_seen) == 2
    finally:
        runner.close()


class CountedGate(Gate):
    """A Gate that counts the engine's waits on the GPU (its `opened` spells)."""

    def __init__(self) -> None:
        super().__init__()
        self.opened_count = 0

    def opened(self) -> Any:
        self.opened_count += 1
        return super().opened()


def test_the_engine_runs_a_step_with_the_gate_closed_and_opens_it_to_wait_on_the_gpu(
    model_dirs: dict[str, Path],
) -> None:
    # (The responder builds responses while the gate is open: responder.py.)
    backend = static_decode.StaticBackend(str(model_dirs["gpt2"]))
    backend.allocate(8, 1 << 20)
    ungated = Runner(backend)
    try:
        expected = ungated.run(PROMPTS, max_new=16)
    finally:
        ungated.close()
    gate = backend.gate = CountedGate()
    runner = Runner(backend, gate=gate)
    try:
        before = backend.forward_passes
        assert runner.run(PROMPTS, max_new=16) == expected
        assert runner.gate_open_at_steps and not any(runner.gate_open_at_steps)
        assert gate.opened_count >= 15  # each decode step's wait for its tokens
        assert gate.opened_count <= backend.forward_passes - before
        assert gate.is_open  # an idle engine leaves it open
    finally:
        runner.close()


def test_steps_launched_ahead_are_taken_and_none_is_run_twice(model_dirs: dict[str, Path]) -> None:
    backend = static_decode.StaticBackend(str(model_dirs["gpt2"]), overlap=True)
    backend.allocate(8, 1 << 20)
    runner = Runner(backend)
    try:
        first = runner.submit(PROMPTS[0], max_new=40)
        first.wait_for_tokens(5)
        others = [runner.submit(p, max_new=12) for p in PROMPTS[1:4]]  # they join a running batch
        for handle in [first, *others]:
            handle.wait()
    finally:
        runner.close()
    assert backend.discarded_passes == 0
    # a prefill per admission and one pass per token after each sequence's first
    assert backend.forward_passes <= 4 + 39
    assert backend.ahead is not None  # (the step after the last token, never taken)


def test_rows_moving_down_under_a_step_launched_ahead_keep_their_tokens(tmp_path: Path) -> None:
    # A model with sharp attention (large random weights): one key or value wrong changes
    # its greedy tokens (the tiny models above often do not notice).
    sharp = save_tiny_llama(tmp_path / "sharp-llama", initializer_range=0.5)
    backend = static_decode.StaticBackend(str(sharp), overlap=True)
    backend.allocate(8, 1 << 20)
    lengths = [6, 30, 11, 30, 3, 25]  # the first rows end first: the later ones move down
    expected = [alone(backend, prompt, max_new=n) for prompt, n in zip(PROMPTS, lengths, strict=False)]
    runner = Runner(backend)
    try:
        handles = [runner.submit(prompt, max_new=n) for prompt, n in zip(PROMPTS, lengths, strict=False)]
        assert [h.wait() for h in handles] == expected
    finally:
        runner.close()
    assert backend.discarded_passes == 0


def test_auto_limits_are_sized_from_the_device() -> None:
    cpu = llm.size_limits(device="cpu", kv_bytes_per_token=46080, tokens_per_block=32, context_length=8192)
    assert cpu.max_active == llm.CPU_MAX_ACTIVE
    assert cpu.kv_blocks == llm.CPU_KV_MEMORY // (46080 * 32)
    cuda = llm.size_limits(
        device="cuda", kv_bytes_per_token=23040, tokens_per_block=32, context_length=8192, free_memory=70 * 2**30
    )
    assert cuda.kv_blocks == int(70 * 2**30 * llm.CUDA_KV_FRACTION) // (23040 * 32)
    assert cuda.max_active == llm.CUDA_MAX_ACTIVE
    small = llm.size_limits(
        device="cuda", kv_bytes_per_token=400_000, tokens_per_block=32, context_length=2048, free_memory=8 * 2**30
    )
    assert small.max_active == small.kv_blocks * 32 // 2048 < llm.CUDA_MAX_ACTIVE
    given = llm.size_limits(
        device="cpu", kv_bytes_per_token=1024, tokens_per_block=32, context_length=256, max_active="3", kv_memory="2MiB"
    )
    assert given == llm.Limits(max_active=3, kv_blocks=64)
    assert llm.parse_bytes("1.5GiB") == 3 * 2**29 and llm.parse_bytes("4096") == 4096


def test_the_kv_bytes_per_token_are_measured_from_the_model(model_dirs: dict[str, Path]) -> None:
    backend = llm.HfBackend(str(model_dirs["llama"]))
    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    assert backend.kv_bytes_per_token == 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
