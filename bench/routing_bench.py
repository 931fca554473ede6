"""Routing benchmark: cache-aware routing against least-outstanding and round-robin, on
the same replicas and load, in one run.

Each replica is its own Triton serving the synthetic engine (the llm_engine code with
no compute): a prompt token it has to prefill costs PREFILL_US, a decode step DECODE_US
for all running requests at once, and its prefix KV cache holds KV_BLOCKS blocks of 32
tokens, LRU. So what routing does to prefill work and cache hits is what is measured,
not this 2-core machine's arithmetic. (The cache is sized so that all replicas together
hold the shared prefixes a little over once: only a router that keeps each prefix on
one replica gets the hits.)

Workloads, Poisson arrivals at RATE per replica:
  shared    8 system prompts of ~400 tokens, each request one of them + a short
            distinct user turn (a chatbot's traffic)
  distinct  the same sizes, but every prompt different (no prefix to share)

Reported per replica count, workload and policy: TTFT p50/p90, end-to-end p50/p99,
output tokens/s, and the engines' prefix-cache hit rate (prompt tokens served from the
cache). Each run uses fresh prompts, so one policy's cache does not help the next.

Run:  .venv/bin/python -m bench.routing_bench                  (2 then 4 replicas)
      .venv/bin/python -m bench.routing_bench --replicas 2 --duration 20 --rate 9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shutil
import sys
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from gateway.stack.process import ManagedProcess, free_port, stop_processes
from gateway.stack.services import gateway_spec, mongo_spec, redis_spec
from gateway.stack.triton import triton_spec
from gateway.stack.weights import build_tiny_gpt2

ROOT = Path(__file__).resolve().parents[1]
POLICIES = ("round_robin", "least_outstanding", "cache_aware")
PREFILL_US = 400  # per uncached prompt token: a 400-token prompt is 160 ms of prefill
DECODE_US = 20_000  # one step for all running requests (50 tokens/s per stream)
MAX_TOKENS = 16
SYSTEM_PROMPTS = 8
PROMPT_TOKENS = 400


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1000


def bench_repo(source: Path, target: Path, kv_blocks: int) -> Path:
    """A model repository with only the synthetic engine, sized for the benchmark."""
    if target.exists():
        shutil.rmtree(target)
    model = target / "llm_synthetic"
    shutil.copytree(source / "llm_synthetic", model, symlinks=False)
    config = (model / "config.pbtxt").read_text()
    for key, value in (
        ("prefill_us_per_token", PREFILL_US),
        ("decode_us", DECODE_US),
        ("kv_cache_max_blocks", kv_blocks),
    ):
        config = re.sub(rf'(key: "{key}" value: {{ string_value: ")[^"]*(")', rf"\g<1>{value}\g<2>", config)
    (model / "config.pbtxt").write_text(config)
    return target


def prompts(tokenizer: Tokenizer, seed: int, shared: bool, count: int) -> list[str]:
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:300] or ["gateway", "triton"]

    def text(n_tokens: int) -> str:
        out: list[str] = []
        while len(tokenizer.encode(" ".join(out)).ids) < n_tokens:
            out.extend(rng.choice(words) for _ in range(20))
        return " ".join(out)

    systems = [text(PROMPT_TOKENS) for _ in range(SYSTEM_PROMPTS)]
    found = []
    for i in range(count):
        turn = f"\nuser {i}: {' '.join(rng.choice(words) for _ in range(6))}?"
        system = rng.choice(systems) if shared else text(PROMPT_TOKENS)
        found.append(system + turn)
    return found


async def one(client: httpx.AsyncClient, prompt: str, outcome: Outcome) -> None:
    body = {"model": "llm_synthetic", "inputs": {"text_input": prompt, "max_tokens": MAX_TOKENS}, "stream": True}
    started = time.perf_counter()
    first = None
    try:
        async with client.stream("POST", "/infer", json=body, headers={"Accept": "text/event-stream"}) as response:
            event = ""
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    event = line[6:].strip()
                elif line.startswith("data:") and event == "token" and first is None:
                    first = time.perf_counter() - started
                elif line.startswith("data:") and event in ("completed", "failed", "canceled", "expired"):
                    record = json.loads(line[5:])
                    if record["status"] != "succeeded":
                        outcome.errors += 1
                        return
                    outcome.tokens += record["usage"]["completion_tokens"]
                    break
    except httpx.HTTPError:
        outcome.errors += 1
        return
    outcome.e2e.append(time.perf_counter() - started)
    if first is not None:
        outcome.ttft.append(first)


async def run_load(url: str, texts: list[str], rate: float, duration: float) -> tuple[Outcome, float]:
    outcome = Outcome()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        rng = random.Random(7)
        tasks = []
        started = time.perf_counter()
        next_at = started
        for text in texts:
            next_at += rng.expovariate(rate)
            if next_at - started > duration:
                break
            await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, text, outcome)))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - started
    return outcome, wall


def engine_counters(metrics_urls: list[str]) -> tuple[float, float]:
    """(prompt tokens served from the prefix cache, prompt tokens computed), all replicas."""
    reused = prefilled = 0.0
    for url in metrics_urls:
        for family in text_string_to_metric_families(httpx.get(url, timeout=5).text):
            for sample in family.samples:
                if sample.labels.get("model") != "llm_synthetic":
                    continue
                if (
                    sample.name == "nv_trt_llm_kv_cache_block_metrics"
                    and sample.labels.get("kv_cache_block_type") == "reused"
                ):
                    reused += sample.value * 32
                elif sample.name == "llm_engine_prefilled_tokens":
                    prefilled += sample.value
    return reused, prefilled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", default="2,4", help="replica counts to run, e.g. 2,4")
    parser.add_argument("--rate", type=float, default=4.5, help="arrivals per second per replica")
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of load per run")
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".stack-bench" / "routing")
    args = parser.parse_args()

    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    model_dir = data / "tiny-gpt2"
    if not (model_dir / "config.json").exists():
        build_tiny_gpt2(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    env = {"LLM_MODEL_DIR": str(model_dir)}
    processes: list[ManagedProcess] = []

    def start(spec) -> ManagedProcess:
        process = ManagedProcess(spec)
        processes.append(process)
        process.start()
        process.wait_ready(time.monotonic() + 300)
        return process

    rows = []
    try:
        redis_port = free_port()
        start(redis_spec(data_dir=data, host="127.0.0.1", port=redis_port, name="redis-routing"))
        mongo_port = free_port()
        start(mongo_spec(data_dir=data, host="127.0.0.1", port=mongo_port))
        for count in [int(n) for n in args.replicas.split(",")]:
            # All replicas together hold the 8 shared prompts ~1.25 times.
            kv_blocks = max(16, int(SYSTEM_PROMPTS * (PROMPT_TOKENS // 32 + 1) * 1.25 / count))
            repo = bench_repo(ROOT / "model_repo" / "local", data / f"repo-{count}", kv_blocks)
            grpc, metrics, tritons = [], [], []
            for i in range(count):
                grpc_port, metrics_port = free_port(), free_port()
                tritons.append(
                    start(
                        triton_spec(
                            name=f"triton-r{count}-{i}",
                            model_repo=repo,
                            data_dir=data,
                            host="127.0.0.1",
                            http_port=free_port(),
                            grpc_port=grpc_port,
                            metrics_port=metrics_port,
                            extra_env=env,
                        )
                    )
                )
                grpc.append(f"127.0.0.1:{grpc_port}")
                metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
            rate = args.rate * count
            for workload, shared in (("shared", True), ("distinct", False)):
                for n, policy in enumerate(POLICIES):
                    port = free_port()
                    gateway = start(
                        gateway_spec(
                            data_dir=data,
                            host="127.0.0.1",
                            port=port,
                            name=f"gateway-{policy}",
                            env={
                                **env,
                                "REDIS_URL": f"redis://127.0.0.1:{redis_port}/{n + 1}",
                                "AUTH_ENABLED": "false",
                                "MONGO_URL": f"mongodb://127.0.0.1:{mongo_port}",
                                "LOG_LEVEL": "WARNING",
                                "TRITON_GRPC_URLS": ",".join(grpc),
                                "TRITON_METRICS_URLS": ",".join(metrics),
                                "LLM_ROUTING": policy,
                                "REPLICA_MAX_INFLIGHT": "256",
                                "BINDER_URLS": "",
                            },
                            ready_path="/healthz",
                        )
                    )
                    texts = prompts(
                        tokenizer,
                        seed=zlib.crc32(f"{count}/{workload}/{policy}".encode()),
                        shared=shared,
                        count=int(rate * args.duration * 2),
                    )
                    before = engine_counters(metrics)
                    outcome, wall = asyncio.run(run_load(f"http://127.0.0.1:{port}", texts, rate, args.duration))
                    after = engine_counters(metrics)
                    reused, computed = after[0] - before[0], after[1] - before[1]
                    hit = reused / (reused + computed) if reused + computed else 0.0
                    row = {
                        "replicas": count,
                        "workload": workload,
                        "policy": policy,
                        "requests": len(outcome.e2e),
                        "errors": outcome.errors,
                        "ttft_p50": pct(outcome.ttft, 50),
                        "ttft_p90": pct(outcome.ttft, 90),
                        "e2e_p50": pct(outcome.e2e, 50),
                        "e2e_p99": pct(outcome.e2e, 99),
                        "tokens_per_s": outcome.tokens / wall,
                        "hit_rate": hit,
                    }
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    stop_processes([gateway])
                    processes.remove(gateway)
            stop_processes(tritons)
            for triton in tritons:
                processes.remove(triton)
    finally:
        stop_processes(processes)
    print(table(rows, args))


def table(rows: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Routing benchmark: synthetic engine (prefill {PREFILL_US} us/token, decode step {DECODE_US / 1000:g} ms, "
        f"{MAX_TOKENS} tokens out), Poisson {args.rate:g} req/s per replica, {args.duration:g} s per run.",
        "",
        "| replicas | workload | policy | requests | TTFT p50 / p90 ms | e2e p50 / p99 ms | output tok/s "
        "| prefix hit rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['replicas']} | {r['workload']} | {r['policy']} | {r['requests']} ({r['errors']} errors) | "
            f"{r['ttft_p50']:.0f} / {r['ttft_p90']:.0f} | {r['e2e_p50']:.0f} / {r['e2e_p99']:.0f} | "
            f"{r['tokens_per_s']:.0f} | {r['hit_rate']:.0%} |"
        )
    lines.append("")
    for count in sorted({r["replicas"] for r in rows}):
        for workload in ("shared", "distinct"):
            by = {r["policy"]: r for r in rows if r["replicas"] == count and r["workload"] == workload}
            if "cache_aware" in by and "least_outstanding" in by:
                ca, lo = by["cache_aware"], by["least_outstanding"]
                ttft = lo["ttft_p90"] / ca["ttft_p90"]
                tokens = ca["tokens_per_s"] / lo["tokens_per_s"]
                lines.append(
                    f"- {count} replicas, {workload}: cache-aware vs least-outstanding: TTFT p90 "
                    f"{ttft:.2f}x lower, tokens/s {tokens:.2f}x"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
