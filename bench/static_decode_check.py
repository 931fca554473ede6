"""Greedy outputs of the llm_engine's StaticBackend (static cache, CUDA graphs on a GPU)
against HfBackend's (eager), the same prompts through the same engine scheduler, batched.

Run (from the repository root), with a Hugging Face causal-LM directory:
  python -m bench.static_decode_check /tmp/gw/models/gpt2m --device cuda --dtype float16
  .venv/bin/python -m bench.static_decode_check DIR --device cpu     (float32: identical)
Prints how many outputs are identical and, for those that differ, where they first do
(fp16 kernels may round a near-tie differently)."""

from __future__ import annotations

import argparse
import random
import sys
import threading
from typing import Any

from bench.engine_bench import ENGINE_DIR


def generate(llm: Any, backend: Any, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Every prompt submitted at once (greedy, no end id); the tokens each one made."""
    from kv_blocks import BlockCache

    engine = llm.Engine(backend, BlockCache(32, 4096), max_active=len(prompts), on_step=lambda _: None)
    outputs: list[list[int]] = [[] for _ in prompts]
    done = [threading.Event() for _ in prompts]
    errors: list[str] = []
    for i, prompt in enumerate(prompts):

        def send(new: list[int], final: bool, i: int = i) -> None:
            outputs[i].extend(new)
            if final:
                done[i].set()

        def fail(message: str, i: int = i) -> None:
            errors.append(message)
            done[i].set()

        sampling = llm.Sampling(max_new=tokens, end_id=-1)
        engine.submit(
            llm.Sequence(
                request_id="", prompt=prompt, sampling=sampling, streaming=True, send=send, fail=fail,
                cancelled=lambda: False,
            )
        )  # fmt: skip
    for event in done:
        event.wait(600)
    engine.close()
    if errors:
        raise SystemExit(f"generation failed: {errors[0]}")
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a Hugging Face causal-LM directory (GPT-2 or Llama-shaped)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--prompts", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()

    sys.path.insert(0, str(ENGINE_DIR))
    import engine as llm
    import static_decode

    eager = llm.HfBackend(args.model, device=args.device, dtype=args.dtype)
    vocab = int(eager.model.config.vocab_size)
    rng = random.Random(1)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randrange(5, 200))] for _ in range(args.prompts)]
    expected = generate(llm, eager, prompts, args.tokens)
    static = static_decode.StaticBackend(args.model, device=args.device, dtype=args.dtype)
    static.allocate(len(prompts), 1 << 22)
    got = generate(llm, static, prompts, args.tokens)
    same = sum(a == b for a, b in zip(expected, got, strict=True))
    print(f"identical outputs: {same} of {len(prompts)} ({args.tokens} tokens each, {args.device} {args.dtype})")
    for i, (a, b) in enumerate(zip(expected, got, strict=True)):
        if a != b:
            first = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"  prompt {i} ({len(prompts[i])} tokens): first differs at token {first}")


if __name__ == "__main__":
    main()
