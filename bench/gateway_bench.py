"""Gateway benchmark: the same model and load, side by side in one run, over
  direct   tritonclient.grpc.aio straight to Triton (the baseline),
  sync     POST /infer with `Prefer: wait` (200 with the result),
  async    POST /infer (202), then GET /results/<id>?wait until it is ready.

Sections (--sections, comma separated; open,closed,ttft,v1,relay by default):
  open     open loop at fixed arrival rates: requests leave on schedule whatever the
           answers do (latency counts from the scheduled send, so a stall is not
           hidden); modes alternate in short slices, rounds repeated, so machine noise
           hits all of them alike.
  closed   throughput: closed loop, a fixed number of concurrent clients per mode, from
           one client process or, with --client-processes P, from P of them (a GPU
           serves more than one Python client can send).
  ttft     time to first token on the synthetic engine (no compute) at 1, 8 and 32
           concurrent streams (--ttft-streams): direct gRPC stream vs POST + SSE vs
           /v1/chat/completions streamed, in one run.
  v1       the cost of the OpenAI layer: non-streamed /v1/chat/completions against
           POST /infer (sync) for the same model and prompt, alternating.
  relay    many concurrent token streams of the synthetic engine (50 tokens/s each):
           inter-token gaps at the client, direct gRPC vs gateway SSE, and every token
           counted (none may be lost).
  llm      real generation with the `llm` model at 1, 8, 32, 128 concurrent streams
           (--llm-streams): TTFT, tokens/s and end-to-end time, direct vs gateway.
  many     many-input embeddings calls: /v1/embeddings of --many-inputs texts per call
           (one request each), base64 and float answers, --many-clients concurrent
           calls, against the same texts straight to Triton in calls of max_batch_size;
           the gateway's CPU per call and per input (the target: 30 µs an input at 64).

Every gateway row also reports the gateway's CPU per request (or per relayed token):
the change of utime + stime of the gateway processes (found by the port they listen
on, workers included) over the row's measured window, divided by what it served
(bench/cpu.py). The closed section's gateway rows also report what the stack's Redis did
per request over their windows (bench/redis_info.py: every command, those inside the
scripts too; its CPU; bytes in and out), with --redis-commands which commands those were.
Error texts are printed under each table.

The HTTP load comes from aiohttp, a lighter client than httpx, so that the client's own
cost on this small machine is not counted as gateway overhead. With several
--gateway-url values (comma separated; a running stack, e.g. one gateway per core), the
load is spread over them in turn.

Run:  .venv/bin/python -m bench.gateway_bench            (starts its own local stack)
      .venv/bin/python -m bench.gateway_bench --rates 50,200 --slice 4 --rounds 2 --clients 64
      .venv/bin/python -m bench.gateway_bench --sections relay --streams 200
      .venv/bin/python -m bench.gateway_bench --sections many --many-inputs 1,64,256 --many-model clip_text
      .venv/bin/python -m bench.gateway_bench --gateway-url http://127.0.0.1:8080 --triton-url 127.0.0.1:8001 \
          --api-key "$(cat .stack/api_key)" --tokenizer-dir .stack/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

import aiohttp
import numpy as np
import tritonclient.grpc.aio as triton_aio

from bench.cpu import ProcessCpu
from bench.redis_info import RedisSample, RedisWindow
from bench.stack import ROOT, local_stack
from gateway.server.models import ModelAdapter
from gateway.server.models.registry import LOCAL_PROFILE, build_adapter

SECTIONS = ("open", "closed", "ttft", "v1", "relay")
ALL_SECTIONS = (*SECTIONS, "llm", "many")
STREAM_MODEL = "llm_synthetic"  # the engine contract with no compute: 20 ms per token

STREAM_INPUTS: dict[str, Any] = {"text_input": "Hello world, the gateway", "max_tokens": 32}


def _photo(fmt: str = "PNG") -> str:
    """A 640x480 RGB picture (a smooth gradient; PNG 5 KB), base64: the CLIP tower resizes it to 224."""
    from PIL import Image

    y, x = np.mgrid[0:480, 0:640]
    pixels = np.stack([x * 255 // 640, y * 255 // 480, (x + y) * 255 // 1120], axis=-1).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return base64.b64encode(out.getvalue()).decode()


INPUTS: dict[str, dict[str, Any]] = {
    "clip_text": {"text": "a photo of a cat sitting on a mat"},
    "clip_image": {"image": _photo()},
    "text_embed": {"text": "a cat sits on the mat"},
    "llm_synthetic": {"text_input": "Hello world, the gateway", "max_tokens": 8},
    # Through the chat template: a raw prompt may get an end token at once from a chat model.
    "llm": {"messages": [{"role": "user", "content": "Write a story about a lighthouse keeper."}], "max_tokens": 64},
}
CHAT = [{"role": "user", "content": "Hello world, the gateway"}]
_ADAPTERS: dict[str, ModelAdapter] = {}


def adapter(model: str) -> ModelAdapter:
    """The local profile's adapter for `model` (LLMs need their tokenizer: $LLM_MODEL_DIR)."""
    if model not in _ADAPTERS:
        spec = next(s for s in LOCAL_PROFILE if s.name == model)
        if spec.tokenizer and "LLM_MODEL_DIR" in spec.tokenizer and not os.environ.get("LLM_MODEL_DIR"):
            raise SystemExit(f"{model} needs the LLM's tokenizer: pass --tokenizer-dir (or set LLM_MODEL_DIR)")
        _ADAPTERS[model] = build_adapter(spec)
    return _ADAPTERS[model]


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    started: float = 0.0
    ended: float = 0.0
    cpu_s: float = 0.0  # the gateway's CPU over the measured windows
    redis: RedisWindow | None = None  # what the stack's Redis did over them, when measured

    def add(self, other: Samples) -> None:
        self.latencies += other.latencies
        self.errors += other.errors
        self.ended += other.ended - other.started  # accumulated wall time of the slices
        self.cpu_s += other.cpu_s
        if other.redis is not None:
            self.redis = other.redis if self.redis is None else self.redis + other.redis

    def pct(self, q: float) -> float:
        return pct(self.latencies, q)

    @property
    def served(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.ended if self.ended else 0.0

    def cpu_ms(self) -> str:
        return f"{self.cpu_s * 1000 / self.served:.2f}" if self.served and self.cpu_s else ""

    def redis_cells(self) -> list[str]:
        """Redis per request: commands, CPU µs, bytes in, bytes out."""
        r, n = self.redis, self.served
        if r is None or not n:
            return [""] * 4
        return [f"{r.commands / n:.1f}", f"{r.cpu_s * 1e6 / n:.0f}", f"{r.bytes_in / n:.0f}", f"{r.bytes_out / n:.0f}"]


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


def ratio(value: float, base: float) -> str:
    return f"{value / base:.0%}" if base else "n/a"


def error_lines(samples: dict[str, Samples]) -> list[str]:
    lines = []
    for mode, s in samples.items():
        for text, count in s.errors.most_common(3):
            lines.append(f"- {mode}: {count} x {text}")
    return ["", "Errors:", *lines] if lines else []


Call = Callable[[], Awaitable[None]]


async def _once(request: dict) -> AsyncIterator[dict]:
    yield request


async def direct_stream(
    client: triton_aio.InferenceServerClient, model: str, inputs: dict, stream: bool
) -> AsyncIterator[int]:
    """Yields the number of tokens (pieces) in each response of a direct gRPC call."""
    model_adapter = adapter(model)
    run = model_adapter.new_run(model_adapter.validate(inputs, {}))
    request = {"model_name": run.triton_model, "inputs": run.inputs(stream), "outputs": run.outputs()}
    if not run.decoupled:
        await client.infer(run.triton_model, request["inputs"], outputs=request["outputs"])
        yield 1
        return
    async for result, error in client.stream_infer(_once(request)):
        if error:
            raise error
        pieces = run.take(result)
        if pieces:
            yield len(pieces)


def direct_call(client: triton_aio.InferenceServerClient, model: str, inputs: dict) -> Call:
    async def call() -> None:
        async for _ in direct_stream(client, model, inputs, stream=False):
            pass

    return call


class Gateways:
    """HTTP sessions to one or more gateways, used in turn, and their CPU."""

    def __init__(self, urls: list[str], api_key: str, measure_cpu: bool = True) -> None:
        self.sessions = [
            aiohttp.ClientSession(
                url,
                # Idle connections are dropped before the gateway's keep-alive (5 s) would close them.
                connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
                timeout=aiohttp.ClientTimeout(total=300),
                headers={"Authorization": f"Bearer {api_key}"},
            )
            for url in urls
        ]
        self._turn = itertools.cycle(self.sessions)
        self.cpu: ProcessCpu | None = None
        try:
            if measure_cpu:
                self.cpu = ProcessCpu.of_urls(urls)
        except Exception as exc:  # a gateway on another host: latency only
            print(f"(gateway CPU not measured: {exc})", flush=True)

    def next(self) -> aiohttp.ClientSession:
        return next(self._turn)

    def cpu_seconds(self) -> float:
        return self.cpu.seconds() if self.cpu is not None else 0.0

    async def close(self) -> None:
        for session in self.sessions:
            await session.close()


def sync_call(http: Gateways, model: str, inputs: dict) -> Call:
    async def call() -> None:
        async with http.next().post(
            "/infer", json={"model": model, "inputs": inputs}, headers={"Prefer": "wait=30"}
        ) as response:
            body = await response.json()
        if response.status != 200 or body["status"] != "succeeded":
            raise RuntimeError(f"{response.status} {str(body)[:160]}")

    return call


def async_call(http: Gateways, model: str, inputs: dict) -> Call:
    async def call() -> None:
        session = http.next()
        async with session.post("/infer", json={"model": model, "inputs": inputs}) as response:
            accepted = await response.json()
        if response.status != 202:
            raise RuntimeError(f"{response.status} {str(accepted)[:160]}")
        while True:
            async with session.get(f"/results/{accepted['request_id']}", params={"wait": "30"}) as response:
                record = await response.json()
            if response.status != 200:  # the poll's own error (a 429, a 503): reported as such
                raise RuntimeError(f"poll {response.status} {str(record)[:160]}")
            if record["status"] in ("succeeded", "failed", "canceled", "expired"):
                if record["status"] != "succeeded":
                    raise RuntimeError(f"{record['status']}: {str(record.get('error'))[:160]}")
                return

    return call


def chat_call(http: Gateways, model: str, max_tokens: int) -> Call:
    async def call() -> None:
        body = {"model": model, "messages": CHAT, "max_tokens": max_tokens}
        async with http.next().post("/v1/chat/completions", json=body) as response:
            answer = await response.json()
        if response.status != 200:
            raise RuntimeError(f"{response.status} {str(answer)[:160]}")

    return call


def _failed(samples: Samples, exc: BaseException) -> None:
    samples.errors[f"{type(exc).__name__}: {exc}"[:200]] += 1


async def open_loop(call: Call, rate: float, seconds: float, cpu: Callable[[], float]) -> Samples:
    samples = Samples()
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    samples.started = time.perf_counter()
    cpu_before = cpu()

    async def one(scheduled: float) -> None:
        try:
            await call()
            samples.latencies.append(loop.time() - scheduled)
        except Exception as exc:
            _failed(samples, exc)

    tasks = []
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    samples.ended = time.perf_counter()
    samples.cpu_s = cpu() - cpu_before
    return samples


async def closed_loop(call: Call, clients: int, seconds: float, cpu: Callable[[], float]) -> Samples:
    samples = Samples(started=time.perf_counter())
    stop = time.perf_counter() + seconds
    cpu_before = cpu()

    async def worker() -> None:
        while time.perf_counter() < stop:
            began = time.perf_counter()
            try:
                await call()
                samples.latencies.append(time.perf_counter() - began)
            except Exception as exc:
                _failed(samples, exc)

    await asyncio.gather(*(worker() for _ in range(clients)))
    samples.ended = time.perf_counter()
    samples.cpu_s = cpu() - cpu_before
    return samples


@dataclass
class ClientJob:
    """One client process's share of a closed loop (it crosses a process boundary)."""

    urls: list[str]
    triton_url: str
    api_key: str
    model: str
    inputs: dict[str, Any]
    mode: str
    clients: int
    seconds: float
    start_at: float  # time.time() at which every process begins measuring


def run_client_job(job: ClientJob) -> tuple[list[float], Counter, float]:
    return asyncio.run(_client_job(job))


async def _client_job(job: ClientJob) -> tuple[list[float], Counter, float]:
    triton = triton_aio.InferenceServerClient(job.triton_url)
    http = Gateways(job.urls, job.api_key, measure_cpu=False)
    call = make_calls(triton, http, job.model, job.inputs)[job.mode]
    try:
        await closed_loop(call, min(job.clients, 8), 0.5, lambda: 0.0)  # connections up, then wait
        await asyncio.sleep(max(0.0, job.start_at - time.time()))
        samples = await closed_loop(call, job.clients, job.seconds, lambda: 0.0)
    finally:
        await http.close()
        await triton.close()
    return samples.latencies, samples.errors, samples.ended - samples.started


async def closed_loop_in_processes(
    pool: ProcessPoolExecutor, args: argparse.Namespace, mode: str, cpu: Callable[[], float]
) -> Samples:
    """The closed loop from args.client_processes processes at once, args.clients in all."""
    count = args.client_processes
    start_at = time.time() + 2.0
    shares = [args.clients // count + (i < args.clients % count) for i in range(count)]
    jobs = [
        ClientJob(args.urls, args.triton, args.api_key, args.model, args.inputs, mode, share, args.slice, start_at)
        for share in shares
    ]
    loop = asyncio.get_running_loop()
    futures = [loop.run_in_executor(pool, run_client_job, job) for job in jobs]
    await asyncio.sleep(max(0.0, start_at - time.time()))
    cpu_before = cpu()
    results = await asyncio.gather(*futures)
    samples = Samples(cpu_s=cpu() - cpu_before)
    for latencies, errors, _wall in results:
        samples.latencies += latencies
        samples.errors += errors
    samples.ended = max(wall for _, _, wall in results)  # Samples.rate: requests / window
    return samples


@dataclass
class StreamTrace:
    """When each token arrived (a coalesced event's tokens arrive together)."""

    began: float
    arrivals: list[float] = field(default_factory=list)
    tokens: int = 0
    expected: int = 0

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.began

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def total(self) -> float:
        return self.arrivals[-1] - self.began if self.arrivals else float("nan")


async def trace_direct(
    client: triton_aio.InferenceServerClient, inputs: dict, model: str = STREAM_MODEL
) -> StreamTrace:
    trace = StreamTrace(began=time.perf_counter(), expected=inputs["max_tokens"])
    async for count in direct_stream(client, model, inputs, stream=True):
        now = time.perf_counter()
        trace.arrivals += [now] * count
        trace.tokens += count
    return trace


async def trace_sse(http: Gateways, inputs: dict, model: str = STREAM_MODEL) -> StreamTrace:
    """POST with Accept: text/event-stream: the events come back on the submit itself."""
    trace = StreamTrace(began=time.perf_counter(), expected=inputs["max_tokens"])
    body = {"model": model, "inputs": inputs, "stream": True}
    event = ""
    async with http.next().post("/infer", json=body, headers={"Accept": "text/event-stream"}) as events:
        async for raw in events.content:
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:") and event == "token":
                count = int(json.loads(line[5:]).get("count", 1))
                now = time.perf_counter()
                trace.arrivals += [now] * count
                trace.tokens += count
            elif line.startswith("data:") and event in ("completed", "failed", "canceled", "expired"):
                break
    return trace


async def trace_chat_stream(http: Gateways, max_tokens: int) -> StreamTrace:
    trace = StreamTrace(began=time.perf_counter(), expected=max_tokens)
    body = {"model": STREAM_MODEL, "messages": CHAT, "max_tokens": max_tokens, "stream": True}
    async with http.next().post("/v1/chat/completions", json=body) as events:
        async for raw in events.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                break
            if line.startswith("data:"):
                chunk = json.loads(line[5:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    trace.arrivals.append(time.perf_counter())
                    trace.tokens += 1
    return trace


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


async def section_open(args: argparse.Namespace, calls: dict[str, Call], http: Gateways) -> list[str]:
    lines = [
        f"Model `{args.model}`, open loop, {args.rounds} rounds x {args.slice:g} s per mode and rate "
        "(latency from the scheduled send):",
        "",
        row("rate (req/s)", "mode", "requests", "errors", "achieved req/s", "p50 ms", "p90 ms", "p99 ms",
            "added p50 ms", "added p99 ms", "gateway CPU ms/req"),
        row(*["---"] * 11),
    ]  # fmt: skip
    all_totals: dict[str, Samples] = {}
    for rate in args.rates:
        totals = {mode: Samples() for mode in calls}
        for _ in range(args.rounds):
            for mode, call in calls.items():
                cpu = http.cpu_seconds if mode != "direct" else (lambda: 0.0)
                totals[mode].add(await open_loop(call, rate, args.slice, cpu))
        base = totals["direct"]
        for mode, s in totals.items():
            added = ("", "") if mode == "direct" else (
                f"{s.pct(50) - base.pct(50):+.2f}", f"{s.pct(99) - base.pct(99):+.2f}"
            )  # fmt: skip
            lines.append(row(rate, mode, len(s.latencies), sum(s.errors.values()), f"{s.rate:.0f}",
                             f"{s.pct(50):.2f}", f"{s.pct(90):.2f}", f"{s.pct(99):.2f}", *added,
                             s.cpu_ms()))  # fmt: skip
            all_totals[f"{mode} at {rate:g}/s"] = s
    return lines + error_lines(all_totals)


async def section_closed(args: argparse.Namespace, calls: dict[str, Call], http: Gateways) -> list[str]:
    lines = [
        f"Throughput, model `{args.model}`, closed loop with {args.clients} concurrent clients "
        f"in {args.client_processes} client process(es), {args.rounds} x {args.slice:g} s per mode:",
        "",
        row("mode", "requests", "errors", "req/s", "p50 ms", "p99 ms", "vs direct", "gateway CPU ms/req",
            "Redis cmds/req", "Redis CPU µs/req", "Redis in B/req", "Redis out B/req"),
        row(*["---"] * 12),
    ]  # fmt: skip
    totals = {mode: Samples() for mode in calls}
    pool = None
    if args.client_processes > 1:
        pool = ProcessPoolExecutor(args.client_processes, mp_context=get_context("spawn"))
    for _ in range(args.rounds):
        for mode, call in calls.items():
            cpu = http.cpu_seconds if mode != "direct" else (lambda: 0.0)
            redis_url = args.redis_url if mode != "direct" else None
            before = RedisSample.at(redis_url) if redis_url else None
            if pool is None:
                samples = await closed_loop(call, args.clients, args.slice, cpu)
            else:
                samples = await closed_loop_in_processes(pool, args, mode, cpu)
            if redis_url and before is not None:
                samples.redis = RedisWindow.between(before, RedisSample.at(redis_url))
            totals[mode].add(samples)
    if pool is not None:
        pool.shutdown()
    for mode, s in totals.items():
        lines.append(row(mode, len(s.latencies), sum(s.errors.values()), f"{s.rate:.0f}", f"{s.pct(50):.2f}",
                         f"{s.pct(99):.2f}", ratio(s.rate, totals["direct"].rate), s.cpu_ms(),
                         *s.redis_cells()))  # fmt: skip
    if args.redis_commands:
        lines += redis_command_lines(totals)
    return lines + error_lines(totals)


def redis_command_lines(totals: dict[str, Samples]) -> list[str]:
    """Which Redis commands the gateway modes' requests cost, per request (the commands
    run inside the scripts counted apart from the EVALSHA that ran them)."""
    per_request = {
        mode: Counter({name: calls / s.served for name, calls in s.redis.calls.items()})
        for mode, s in totals.items()
        if s.redis is not None and s.served
    }
    if not per_request:
        return []
    usec = {
        mode: {name: u / s.served for name, u in s.redis.usec.items()}
        for mode, s in totals.items()
        if s.redis is not None and s.served
    }
    lines = ["", "Redis commands per request, and µs executing them (an EVALSHA's include its script's):", ""]
    lines.append(row("command", *per_request, *(f"{mode} µs" for mode in per_request)))
    lines.append(row(*["---"] * (2 * len(per_request) + 1)))
    for name, _ in sum(per_request.values(), Counter()).most_common():
        lines.append(row(name, *(f"{counts[name]:.2f}" for counts in per_request.values()),
                         *(f"{usec[mode].get(name, 0):.1f}" for mode in per_request)))  # fmt: skip
    return lines


async def section_ttft(args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http: Gateways) -> list[str]:
    names = {
        "direct": "direct gRPC stream_infer",
        "sse": "gateway POST /infer, events in the answer (SSE)",
        "chat": "gateway /v1/chat/completions, stream=true",
    }
    lines = [
        f"Time to first token, `{STREAM_MODEL}` (no compute, {STREAM_INPUTS['max_tokens']} tokens), "
        f"{args.ttft_samples} rounds per concurrency, paths alternating within each round:",
        "",
        row("concurrent streams", "path", "median TTFT ms", "p90 ms", "added median ms"),
        row(*["---"] * 5),
    ]
    starts = {
        "direct": lambda: trace_direct(triton, STREAM_INPUTS),
        "sse": lambda: trace_sse(http, STREAM_INPUTS),
        "chat": lambda: trace_chat_stream(http, STREAM_INPUTS["max_tokens"]),
    }
    for streams in args.ttft_streams:
        paths: dict[str, list[float]] = {key: [] for key in starts}
        rounds = max(1, args.ttft_samples // streams) if streams > 1 else args.ttft_samples
        for _ in range(rounds):
            for key, start in starts.items():
                traces = await asyncio.gather(*(start() for _ in range(streams)))
                paths[key] += [t.ttft for t in traces if t.arrivals]
        base = statistics.median(paths["direct"]) * 1000
        for key, values in paths.items():
            median = statistics.median(values) * 1000
            lines.append(row(streams, names[key], f"{median:.2f}", f"{pct(values, 90):.2f}", f"{median - base:+.2f}"))
    return lines


async def section_v1(args: argparse.Namespace, http: Gateways) -> list[str]:
    """Non-streamed chat against /infer (sync) on the same engine, 1 token: the OpenAI layer's cost."""
    native = sync_call(http, STREAM_MODEL, {"text_input": CHAT[0]["content"], "max_tokens": 1})
    chat = chat_call(http, STREAM_MODEL, 1)
    times: dict[str, list[float]] = {"infer": [], "chat": []}
    for _ in range(args.ttft_samples * 2):
        for key, call in (("infer", native), ("chat", chat)):
            began = time.perf_counter()
            await call()
            times[key].append(time.perf_counter() - began)
    base = statistics.median(times["infer"]) * 1000
    lines = [
        f"The OpenAI layer, `{STREAM_MODEL}`, max_tokens 1, {args.ttft_samples * 2} sequential calls each, "
        "alternating:",
        "",
        row("path", "median ms", "p90 ms", "added median ms"),
        row(*["---"] * 4),
    ]
    for key, label in (("infer", "POST /infer, Prefer: wait"), ("chat", "POST /v1/chat/completions")):
        median = statistics.median(times[key]) * 1000
        lines.append(row(label, f"{median:.2f}", f"{pct(times[key], 90):.2f}", f"{median - base:+.2f}"))
    return lines


def many_texts(count: int) -> list[str]:
    """Sentences of a RAG ingestion's chunk size (~20 tokens), each its own."""
    line = "the harbour master logged {} ships and a storm front moving in from the west"
    return [f"Passage {i}: " + line.format(i % 7) for i in range(count)]


def many_call(http: Gateways, model: str, texts: list[str], encoding: str) -> Call:
    body = {"model": model, "input": texts, "encoding_format": encoding}

    async def call() -> None:
        async with http.next().post("/v1/embeddings", json=body) as response:
            answer = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{response.status} {answer[:160]!r}")

    return call


def many_direct_call(triton: triton_aio.InferenceServerClient, model: str, texts: list[str], max_batch: int) -> Call:
    embedder = adapter(model)
    names = (getattr(embedder, "input_name", "text"), getattr(embedder, "output_name", "embedding"))

    async def call() -> None:
        for start in range(0, len(texts), max_batch):
            chunk = texts[start : start + max_batch]
            batch = triton_aio.InferInput(names[0], [len(chunk), 1], "BYTES")
            batch.set_data_from_numpy(np.array([[t.encode()] for t in chunk], dtype=np.object_))
            await triton.infer(embedder.triton_model, [batch], outputs=[triton_aio.InferRequestedOutput(names[1])])

    return call


async def section_many(args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http: Gateways) -> list[str]:
    """Many-input /v1/embeddings calls (one request each): the gateway's CPU per input. A slow
    model (MiniLM on a small CPU) leaves few calls a second, so the gateway's idle CPU (its
    loops and probes, measured first over as long a window) is also subtracted: `net`."""
    lines: list[str] = []
    for count in args.many_inputs:
        lines += await _many(args, triton, http, count)
    return lines


async def _many(
    args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http: Gateways, count: int
) -> list[str]:
    model, texts = args.many_model, many_texts(count)
    config = await triton.get_model_config(adapter(model).triton_model, as_json=True)
    max_batch = max(1, int(config.get("config", {}).get("max_batch_size", 1)))
    calls = {
        "direct": many_direct_call(triton, model, texts, max_batch),
        "v1 base64": many_call(http, model, texts, "base64"),
        "v1 float": many_call(http, model, texts, "float"),
    }
    for call in calls.values():  # warm up every path
        await closed_loop(call, 2, 1, lambda: 0.0)
    idle_before, idle_started = http.cpu_seconds(), time.perf_counter()
    await asyncio.sleep(args.slice)
    idle_rate = (http.cpu_seconds() - idle_before) / (time.perf_counter() - idle_started)
    totals = {mode: Samples() for mode in calls}
    for _ in range(args.rounds):
        for mode, call in calls.items():
            cpu = http.cpu_seconds if mode != "direct" else (lambda: 0.0)
            totals[mode].add(await closed_loop(call, args.many_clients, args.slice, cpu))
    lines = [
        "",
        f"Many-input calls, `{model}`, {count} inputs a call (Triton's max_batch_size {max_batch}), "
        f"{args.many_clients} concurrent calls, {args.rounds} x {args.slice:g} s per mode; the gateway idle: "
        f"{idle_rate * 1000:.1f} ms of CPU a second:",
        "",
        row("mode", "calls", "errors", "calls/s", "inputs/s", "p50 ms", "p99 ms", "gateway CPU ms/call",
            "µs/input", "net of idle ms/call", "net µs/input"),
        row(*["---"] * 11),
    ]  # fmt: skip
    for mode, s in totals.items():
        cells = ["", "", ""]
        if s.served and s.cpu_s:
            net_s = max(0.0, s.cpu_s - idle_rate * s.ended)
            inputs = s.served * count
            cells = [f"{s.cpu_s * 1e6 / inputs:.1f}", f"{net_s * 1e3 / s.served:.2f}", f"{net_s * 1e6 / inputs:.1f}"]
        lines.append(row(mode, len(s.latencies), sum(s.errors.values()), f"{s.rate:.1f}",
                         f"{s.rate * count:.0f}", f"{s.pct(50):.1f}", f"{s.pct(99):.1f}",
                         s.cpu_ms(), *cells))  # fmt: skip
    return lines + error_lines(totals)


async def _streams(start: Callable[[], Awaitable[StreamTrace]], count: int) -> tuple[list[StreamTrace], float, Counter]:
    began = time.perf_counter()
    traces = await asyncio.gather(*(start() for _ in range(count)), return_exceptions=True)
    wall = time.perf_counter() - began
    errors = Counter(f"{type(t).__name__}: {t}"[:200] for t in traces if isinstance(t, BaseException))
    errors["ended without a token"] += sum(1 for t in traces if isinstance(t, StreamTrace) and not t.arrivals)
    return [t for t in traces if isinstance(t, StreamTrace) and t.arrivals], wall, +errors


async def section_relay(
    args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http: Gateways
) -> list[str]:
    inputs = {"text_input": "Relay this", "max_tokens": args.stream_tokens}
    lines = [
        f"Relay: {args.streams} concurrent streams of `{STREAM_MODEL}` "
        f"({1e6 / float(os.environ.get('STACK_SYNTHETIC_DECODE_US', 20_000)):.0f} tokens/s each), {args.stream_tokens} "
        "tokens per stream, started together; gaps between tokens as the client sees them:",
        "",
        row("path", "streams", "tokens expected", "tokens received", "tokens/s", "vs direct", "gap p50 ms",
            "gap p99 ms", "TTFT p50 ms", "TTFT p99 ms", "gateway CPU µs/token"),
        row(*["---"] * 11),
    ]  # fmt: skip
    direct_rate = 0.0
    errors: dict[str, Samples] = {}
    redis_window: RedisWindow | None = None
    redis_tokens = 0
    for label, start in (
        ("direct gRPC", lambda: trace_direct(triton, inputs)),
        ("gateway SSE", lambda: trace_sse(http, inputs)),
    ):
        redis_before = RedisSample.at(args.redis_url) if args.redis_url and label != "direct gRPC" else None
        cpu_before = http.cpu_seconds()
        ok, wall, failed = await _streams(start, args.streams)
        cpu_s = http.cpu_seconds() - cpu_before
        if redis_before is not None:
            redis_window = RedisWindow.between(redis_before, RedisSample.at(args.redis_url))
            redis_tokens = sum(t.tokens for t in ok)
        errors[label] = Samples(errors=failed)
        gaps = [g for t in ok for g in t.gaps()]
        received = sum(t.tokens for t in ok)
        rate = received / wall
        direct_rate = direct_rate or rate
        per_token = f"{cpu_s * 1e6 / received:.1f}" if label != "direct gRPC" and received else ""
        lines.append(row(label, f"{len(ok)}/{args.streams}", args.streams * args.stream_tokens, received,
                         f"{rate:.0f}", ratio(rate, direct_rate), f"{pct(gaps, 50):.1f}", f"{pct(gaps, 99):.1f}",
                         f"{pct([t.ttft for t in ok], 50):.1f}", f"{pct([t.ttft for t in ok], 99):.1f}",
                         per_token))  # fmt: skip
    if redis_window is not None and redis_tokens:
        cpu_a_token = redis_window.cpu_s * 1e6 / redis_tokens
        lines += ["", f"Redis during the gateway's relay: {cpu_a_token:.1f} µs of CPU a token; the commands a "
                  "token, the costliest first (calls, µs executing them; an EVALSHA's include its script's):", "",
                  row("command", "calls a token", "µs a token"), row("---", "---", "---")]  # fmt: skip
        for name, usec in redis_window.usec.most_common(8):  # the costliest first
            lines.append(row(name, f"{redis_window.calls[name] / redis_tokens:.3f}", f"{usec / redis_tokens:.2f}"))
    return lines + error_lines(errors)


async def section_llm(args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http: Gateways) -> list[str]:
    """Real generation: the `llm` model (the engine stand-in, or TensorRT-LLM) streamed."""
    inputs = {**INPUTS["llm"], "max_tokens": args.llm_tokens}
    lines = [
        f"Real generation, `llm`, {args.llm_tokens} tokens per stream (greedy), streams started together; "
        "below 8 streams, 8 / streams rounds with the paths alternating (after a warm-up stream on each):",
        "",
        row("streams", "path", "ok", "TTFT p50 ms", "TTFT p90 ms", "end-to-end p50 s", "tokens/s", "vs direct",
            "gateway CPU µs/token"),
        row(*["---"] * 9),
    ]  # fmt: skip
    errors: dict[str, Samples] = {}
    paths: dict[str, Callable[[], Awaitable[StreamTrace]]] = {
        "direct gRPC": lambda: trace_direct(triton, inputs, "llm"),
        "gateway SSE": lambda: trace_sse(http, inputs, "llm"),
    }
    for start in paths.values():
        await _streams(start, 1)
    for streams in args.llm_streams:
        direct_rate = 0.0
        rounds = max(1, 8 // streams)
        traces: dict[str, list[StreamTrace]] = {label: [] for label in paths}
        walls = dict.fromkeys(paths, 0.0)
        cpus = dict.fromkeys(paths, 0.0)
        for _ in range(rounds):
            for label, start in paths.items():
                cpu_before = http.cpu_seconds()
                ok, wall, failed = await _streams(start, streams)
                cpus[label] += http.cpu_seconds() - cpu_before
                traces[label] += ok
                walls[label] += wall
                errors.setdefault(f"{label} x{streams}", Samples()).errors.update(failed)
        for label, ok in traces.items():
            tokens = sum(t.tokens for t in ok)
            rate = tokens / walls[label]
            cpu_s = cpus[label]
            direct_rate = direct_rate or rate
            per_token = f"{cpu_s * 1e6 / tokens:.1f}" if label != "direct gRPC" and tokens else ""
            lines.append(row(streams, label, f"{len(ok)}/{streams * rounds}", f"{pct([t.ttft for t in ok], 50):.1f}",
                             f"{pct([t.ttft for t in ok], 90):.1f}", f"{statistics.median([t.total for t in ok]):.2f}"
                             if ok else "", f"{rate:.0f}", ratio(rate, direct_rate), per_token))  # fmt: skip
    return lines + error_lines(errors)


def make_calls(
    triton: triton_aio.InferenceServerClient, http: Gateways, model: str, inputs: dict[str, Any]
) -> dict[str, Call]:
    return {
        "direct": direct_call(triton, model, inputs),
        "sync": sync_call(http, model, inputs),
        "async": async_call(http, model, inputs),
    }


def model_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """The request each call sends: INPUTS', clip_image's picture as --image-format asks."""
    if args.model == "clip_image" and args.image_format != "png":
        return {"image": _photo(args.image_format.upper())}
    return INPUTS[args.model]


async def run(
    args: argparse.Namespace, gateway_urls: list[str], triton_url: str, api_key: str, redis_url: str | None = None
) -> str:
    args.urls, args.triton, args.api_key = gateway_urls, triton_url, api_key  # for client processes
    args.redis_url = redis_url
    triton = triton_aio.InferenceServerClient(triton_url)
    http = Gateways(gateway_urls, api_key)
    args.inputs = model_inputs(args)
    calls = make_calls(triton, http, args.model, args.inputs)
    limits_before = None
    if args.tenant_limits:
        rpm, tpm = args.tenant_limits
        limits = {"requests_per_minute": rpm, "tokens_per_minute": tpm}
        limits_before = await set_tenant_limits(http, limits, {"model": args.model, "inputs": args.inputs})
    try:
        if {"open", "closed"} & set(args.sections):
            for call in calls.values():  # warm up every path
                await closed_loop(call, 8, 2, lambda: 0.0)
        processes = f", {http.cpu.count} gateway processes" if http.cpu is not None else ""
        report: list[str] = [f"Gateways {', '.join(gateway_urls)}{processes}; Triton {triton_url}.", ""]
        printed = 0
        for section in args.sections:
            if section == "open":
                report += await section_open(args, calls, http)
            elif section == "closed":
                report += await section_closed(args, calls, http)
            elif section == "ttft":
                report += await section_ttft(args, triton, http)
            elif section == "v1":
                report += await section_v1(args, http)
            elif section == "relay":
                report += await section_relay(args, triton, http)
            elif section == "llm":
                report += await section_llm(args, triton, http)
            elif section == "many":
                report += await section_many(args, triton, http)
            report.append("")
            print("\n".join(report[printed:]), flush=True)  # each section as it ends: partial results survive
            printed = len(report)
    finally:
        if limits_before is not None:
            await set_tenant_limits(http, limits_before)
    await http.close()
    await triton.close()
    return "\n".join(report)


async def set_tenant_limits(
    http: Gateways, limits: dict[str, int], probe: dict[str, Any] | None = None
) -> dict[str, int]:
    """Set the rate limits of the key's tenant (the stack's Redis keeps them: the caller puts
    back what this returns, the limits before), and with `probe` (a body for POST /infer)
    wait until a gateway answers as they say (with rate-limit headers or without)."""
    session = http.next()
    async with session.get("/usage") as response:
        tenant = (await response.json())["tenant"]
    async with session.get(f"/admin/tenants/{tenant}") as response:
        before = (await response.json())["limits"]
    async with session.put(f"/admin/tenants/{tenant}", json={"limits": limits}) as response:
        response.raise_for_status()
    for _ in range(600 if probe else 0):
        async with session.post("/infer", json=probe) as response:
            await response.read()
            limited = "x-ratelimit-limit-requests" in response.headers or "x-ratelimit-limit-tokens" in response.headers
            if limited == any(limits.values()):
                break
        await asyncio.sleep(0.1)
    else:
        if probe:
            raise RuntimeError(f"the gateway did not apply tenant {tenant}'s limits within a minute")
    return {name: before[name] for name in limits}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(ALL_SECTIONS)}")
    parser.add_argument("--rates", default="50,200", help="arrival rates, req/s")
    parser.add_argument("--slice", type=float, default=4.0, help="seconds per mode per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients for the throughput test")
    parser.add_argument("--client-processes", type=int, default=1, help="processes the closed loop's clients run in")
    parser.add_argument("--ttft-samples", type=int, default=30)
    parser.add_argument("--ttft-streams", default="1,8,32", help="concurrent streams for the TTFT section")
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams for the relay test")
    parser.add_argument("--stream-tokens", type=int, default=100)
    parser.add_argument("--llm-streams", default="1,8,32,128", help="concurrent streams for the llm section")
    parser.add_argument("--llm-tokens", type=int, default=64)
    parser.add_argument("--many-inputs", default="64", help="inputs per call of the many section (several: 1,64,256)")
    parser.add_argument("--many-model", default="text_embed", help="the text embedding model of the many section")
    parser.add_argument("--many-clients", type=int, default=4, help="concurrent calls of the many section")
    parser.add_argument("--model", default="clip_text", choices=sorted(INPUTS))
    parser.add_argument("--image-format", default="png", choices=("png", "jpeg"), help="clip_image's picture")
    parser.add_argument("--workers", type=int, default=1, help="gateway processes of the stack it starts")
    parser.add_argument("--gateway-url", help="running gateways (comma separated), with --triton-url")
    parser.add_argument("--triton-url")
    parser.add_argument("--api-key", default="", help="with --gateway-url")
    parser.add_argument("--redis-url", help="with --gateway-url: the stack's Redis, for the Redis columns")
    parser.add_argument(
        "--redis-commands", action="store_true", help="print which Redis commands a request costs (closed section)"
    )
    parser.add_argument(
        "--tenant-limits",
        help="RPM,TPM: give the key's tenant these rate limits first (set high: counted, nothing refused)",
    )
    parser.add_argument("--tokenizer-dir", help="the LLM's tokenizer directory (default $LLM_MODEL_DIR)")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.sections = [s for s in args.sections.split(",") if s]
    args.ttft_streams = _ints(args.ttft_streams)
    args.llm_streams = _ints(args.llm_streams)
    args.many_inputs = _ints(args.many_inputs)
    args.tenant_limits = _ints(args.tenant_limits) if args.tenant_limits else None
    unknown = set(args.sections) - set(ALL_SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}")
    if args.tokenizer_dir:
        os.environ["LLM_MODEL_DIR"] = args.tokenizer_dir
    if args.gateway_url and args.triton_url:
        urls = [u.strip() for u in args.gateway_url.split(",") if u.strip()]
        report = asyncio.run(run(args, urls, args.triton_url, args.api_key, args.redis_url))
    else:
        # The stack as `make up` starts it (REPLICA_MAX_INFLIGHT 32: issue 61 found the
        # bench's 208 where make up has 32 the one setting apart), but for the stream
        # sections, which run every stream at once: the gateway may keep that many on one
        # replica then. bench/stack.py sets LOG_LEVEL=WARNING too (the access lines off).
        streams = [args.streams + 8] if "relay" in args.sections else []
        streams += args.llm_streams if "llm" in args.sections else []
        changed: dict[str, str] = {}
        if streams and max(streams) > 32:
            changed["REPLICA_MAX_INFLIGHT"] = str(max(streams))
        print(f"stack: as make up starts it, LOG_LEVEL=WARNING, {changed or 'nothing else changed'}", file=sys.stderr)
        with local_stack(ROOT / ".stack-bench", args.workers, **changed) as endpoints:
            assert endpoints.stack is not None
            os.environ.setdefault("LLM_MODEL_DIR", endpoints.stack.service_env["LLM_MODEL_DIR"])
            report = asyncio.run(
                run(args, [endpoints.gateway], endpoints.triton_grpc, endpoints.api_key, endpoints.redis)
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"report": report}, out)


if __name__ == "__main__":
    main()
