"""Gateway benchmark: the same model and load, side by side in one run, over
  direct   tritonclient.grpc.aio straight to Triton (the baseline),
  sync     POST /infer with `Prefer: wait` (200 with the result),
  async    POST /infer (202), then GET /results/<id>?wait until it is ready.

Sections (--sections, comma separated; all by default):
  open     open loop at fixed arrival rates: requests leave on schedule whatever the
           answers do (latency counts from the scheduled send, so a stall is not
           hidden); modes alternate in short slices, rounds repeated, so machine noise
           hits all of them alike.
  closed   throughput: closed loop, a fixed number of concurrent clients per mode.
  ttft     time to first token on the synthetic engine (no compute): direct gRPC
           stream vs POST + SSE vs /v1/chat/completions streamed.
  v1       the cost of the OpenAI layer: non-streamed /v1/chat/completions against
           POST /infer (sync) for the same model and prompt, alternating.
  relay    many concurrent token streams of the synthetic engine (50 tokens/s each):
           inter-token gaps at the client, direct gRPC vs gateway SSE, and every token
           counted (none may be lost).

The HTTP load comes from aiohttp, a lighter client than httpx, so that the client's own
cost on this small machine is not counted as gateway overhead.

Run:  .venv/bin/python -m bench.gateway_bench            (starts its own local stack)
      .venv/bin/python -m bench.gateway_bench --rates 50,200 --slice 4 --rounds 2 --clients 64
      .venv/bin/python -m bench.gateway_bench --sections relay --streams 200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import tritonclient.grpc.aio as triton_aio

from bench.stack import local_stack
from gateway.server.models import ModelRegistry

# The local profile's registry, built once the stack says where the LLM's tokenizer is.
REGISTRY: ModelRegistry | None = None
SECTIONS = ("open", "closed", "ttft", "v1", "relay")
STREAM_MODEL = "llm_synthetic"  # the engine contract with no compute: 20 ms per token


STREAM_INPUTS = {"text_input": "Hello world, the gateway", "max_tokens": 32}
INPUTS = {
    "clip_text": {"text": "a photo of a cat sitting on a mat"},
    "text_embed": {"text": "a cat sits on the mat"},
    "llm_synthetic": {"text_input": "Hello world, the gateway", "max_tokens": 8},
}
CHAT = [{"role": "user", "content": "Hello world, the gateway"}]


@dataclass
class Samples:
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    started: float = 0.0
    ended: float = 0.0

    def add(self, other: Samples) -> None:
        self.latencies += other.latencies
        self.errors += other.errors
        self.ended += other.ended - other.started  # accumulated wall time of the slices

    def pct(self, q: float) -> float:
        return pct(self.latencies, q)

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.ended if self.ended else 0.0


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1000 if values else float("nan")


Call = Callable[[], Awaitable[None]]


async def _once(request: dict) -> AsyncIterator[dict]:
    yield request


async def direct_stream(
    client: triton_aio.InferenceServerClient, model: str, inputs: dict, stream: bool
) -> AsyncIterator[int]:
    """Yields the number of tokens (pieces) in each response of a direct gRPC call."""
    assert REGISTRY is not None
    adapter = REGISTRY.get(model)
    run = adapter.new_run(adapter.validate(inputs, {}))
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


def sync_call(http: aiohttp.ClientSession, model: str, inputs: dict) -> Call:
    async def call() -> None:
        async with http.post(
            "/infer", json={"model": model, "inputs": inputs}, headers={"Prefer": "wait=30"}
        ) as response:
            body = await response.json()
        if response.status != 200 or body["status"] != "succeeded":
            raise RuntimeError(str(body)[:200])

    return call


def async_call(http: aiohttp.ClientSession, model: str, inputs: dict) -> Call:
    async def call() -> None:
        async with http.post("/infer", json={"model": model, "inputs": inputs}) as response:
            accepted = await response.json()
        if response.status != 202:
            raise RuntimeError(str(accepted)[:200])
        while True:
            async with http.get(f"/results/{accepted['request_id']}", params={"wait": "30"}) as response:
                record = await response.json()
            if record["status"] in ("succeeded", "failed", "canceled", "expired"):
                if record["status"] != "succeeded":
                    raise RuntimeError(record["status"])
                return

    return call


def chat_call(http: aiohttp.ClientSession, model: str, max_tokens: int) -> Call:
    async def call() -> None:
        body = {"model": model, "messages": CHAT, "max_tokens": max_tokens}
        async with http.post("/v1/chat/completions", json=body) as response:
            answer = await response.json()
        if response.status != 200:
            raise RuntimeError(str(answer)[:200])

    return call


async def open_loop(call: Call, rate: float, seconds: float) -> Samples:
    samples = Samples()
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.05
    samples.started = time.perf_counter()

    async def one(scheduled: float) -> None:
        try:
            await call()
            samples.latencies.append(loop.time() - scheduled)
        except Exception:
            samples.errors += 1

    tasks = []
    for i in range(int(rate * seconds)):
        scheduled = start + i / rate
        delay = scheduled - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(scheduled)))
    await asyncio.gather(*tasks)
    samples.ended = time.perf_counter()
    return samples


async def closed_loop(call: Call, clients: int, seconds: float) -> Samples:
    samples = Samples(started=time.perf_counter())
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < stop:
            began = time.perf_counter()
            try:
                await call()
                samples.latencies.append(time.perf_counter() - began)
            except Exception:
                samples.errors += 1

    await asyncio.gather(*(worker() for _ in range(clients)))
    samples.ended = time.perf_counter()
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


async def trace_direct(client: triton_aio.InferenceServerClient, inputs: dict) -> StreamTrace:
    trace = StreamTrace(began=time.perf_counter(), expected=inputs["max_tokens"])
    async for count in direct_stream(client, STREAM_MODEL, inputs, stream=True):
        now = time.perf_counter()
        trace.arrivals += [now] * count
        trace.tokens += count
    return trace


async def trace_sse(http: aiohttp.ClientSession, inputs: dict) -> StreamTrace:
    """POST with Accept: text/event-stream: the events come back on the submit itself."""
    trace = StreamTrace(began=time.perf_counter(), expected=inputs["max_tokens"])
    body = {"model": STREAM_MODEL, "inputs": inputs, "stream": True}
    event = ""
    async with http.post("/infer", json=body, headers={"Accept": "text/event-stream"}) as events:
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


async def trace_chat_stream(http: aiohttp.ClientSession, max_tokens: int) -> StreamTrace:
    trace = StreamTrace(began=time.perf_counter(), expected=max_tokens)
    body = {"model": STREAM_MODEL, "messages": CHAT, "max_tokens": max_tokens, "stream": True}
    async with http.post("/v1/chat/completions", json=body) as events:
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


async def section_open(args: argparse.Namespace, calls: dict[str, Call]) -> list[str]:
    lines = [
        f"Model `{args.model}`, open loop, {args.rounds} rounds x {args.slice:g} s per mode and rate "
        "(latency from the scheduled send).",
        "",
        row("rate (req/s)", "mode", "requests", "errors", "achieved req/s", "p50 ms", "p90 ms", "p99 ms",
            "added p50 ms", "added p99 ms"),
        row(*["---"] * 10),
    ]  # fmt: skip
    for rate in args.rates:
        totals = {mode: Samples() for mode in calls}
        for _ in range(args.rounds):
            for mode, call in calls.items():
                totals[mode].add(await open_loop(call, rate, args.slice))
        base = totals["direct"]
        for mode, s in totals.items():
            added = ("", "") if mode == "direct" else (
                f"{s.pct(50) - base.pct(50):+.2f}", f"{s.pct(99) - base.pct(99):+.2f}"
            )  # fmt: skip
            lines.append(row(rate, mode, len(s.latencies), s.errors, f"{s.rate:.0f}", f"{s.pct(50):.2f}",
                             f"{s.pct(90):.2f}", f"{s.pct(99):.2f}", *added))  # fmt: skip
    return lines


async def section_closed(args: argparse.Namespace, calls: dict[str, Call]) -> list[str]:
    lines = [
        f"Throughput, model `{args.model}`, closed loop with {args.clients} concurrent clients, "
        f"{args.rounds} x {args.slice:g} s per mode:",
        "",
        row("mode", "requests", "errors", "req/s", "p50 ms", "p99 ms", "vs direct"),
        row(*["---"] * 7),
    ]
    totals = {mode: Samples() for mode in calls}
    for _ in range(args.rounds):
        for mode, call in calls.items():
            totals[mode].add(await closed_loop(call, args.clients, args.slice))
    for mode, s in totals.items():
        lines.append(row(mode, len(s.latencies), s.errors, f"{s.rate:.0f}", f"{s.pct(50):.2f}",
                         f"{s.pct(99):.2f}", f"{s.rate / totals['direct'].rate:.0%}"))  # fmt: skip
    return lines


async def section_ttft(args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http) -> list[str]:
    paths: dict[str, list[float]] = {"direct": [], "sse": [], "chat": []}
    for _ in range(args.ttft_samples):
        paths["direct"].append((await trace_direct(triton, STREAM_INPUTS)).ttft)
        paths["sse"].append((await trace_sse(http, STREAM_INPUTS)).ttft)
        paths["chat"].append((await trace_chat_stream(http, STREAM_INPUTS["max_tokens"])).ttft)
    base = statistics.median(paths["direct"]) * 1000
    names = {
        "direct": "direct gRPC stream_infer",
        "sse": "gateway POST /infer, events in the answer (SSE)",
        "chat": "gateway /v1/chat/completions, stream=true",
    }
    lines = [
        f"Time to first token, `{STREAM_MODEL}` (no compute), {args.ttft_samples} sequential requests each, "
        "alternating:",
        "",
        row("path", "median TTFT ms", "p90 ms", "added median ms"),
        row(*["---"] * 4),
    ]
    for key, values in paths.items():
        median = statistics.median(values) * 1000
        lines.append(row(names[key], f"{median:.2f}", f"{pct(values, 90):.2f}", f"{median - base:+.2f}"))
    return lines


async def section_v1(args: argparse.Namespace, http: aiohttp.ClientSession) -> list[str]:
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


async def section_relay(args: argparse.Namespace, triton: triton_aio.InferenceServerClient, http) -> list[str]:
    inputs = {"text_input": "Relay this", "max_tokens": args.stream_tokens}
    lines = [
        f"Relay: {args.streams} concurrent streams of `{STREAM_MODEL}` (50 tokens/s each), {args.stream_tokens} "
        "tokens per stream, started together; gaps between tokens as the client sees them:",
        "",
        row("path", "streams", "tokens expected", "tokens received", "tokens/s", "gap p50 ms", "gap p99 ms",
            "TTFT p50 ms", "TTFT p99 ms"),
        row(*["---"] * 9),
    ]  # fmt: skip
    for label, start in (
        ("direct gRPC", lambda: trace_direct(triton, inputs)),
        ("gateway SSE", lambda: trace_sse(http, inputs)),
    ):
        began = time.perf_counter()
        traces = await asyncio.gather(*(start() for _ in range(args.streams)), return_exceptions=True)
        wall = time.perf_counter() - began
        ok = [t for t in traces if isinstance(t, StreamTrace) and t.arrivals]
        gaps = [g for t in ok for g in t.gaps()]
        received = sum(t.tokens for t in ok)
        lines.append(row(label, f"{len(ok)}/{args.streams}", args.streams * args.stream_tokens, received,
                         f"{received / wall:.0f}", f"{pct(gaps, 50):.1f}", f"{pct(gaps, 99):.1f}",
                         f"{pct([t.ttft for t in ok], 50):.1f}", f"{pct([t.ttft for t in ok], 99):.1f}"))  # fmt: skip
    return lines


async def run(args: argparse.Namespace, gateway_url: str, triton_url: str, api_key: str) -> str:
    global REGISTRY
    REGISTRY = ModelRegistry.from_file(None)
    triton = triton_aio.InferenceServerClient(triton_url)
    http = aiohttp.ClientSession(
        gateway_url,
        # Idle connections are dropped before the gateway's keep-alive (5 s) would close them.
        connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=2.0),
        timeout=aiohttp.ClientTimeout(total=120),
        headers={"Authorization": f"Bearer {api_key}"},
    )
    calls = {
        "direct": direct_call(triton, args.model, INPUTS[args.model]),
        "sync": sync_call(http, args.model, INPUTS[args.model]),
        "async": async_call(http, args.model, INPUTS[args.model]),
    }
    for call in calls.values():  # warm up every path
        await closed_loop(call, 8, 2)
    report: list[str] = []
    for section in args.sections:
        if section == "open":
            report += await section_open(args, calls)
        elif section == "closed":
            report += await section_closed(args, calls)
        elif section == "ttft":
            report += await section_ttft(args, triton, http)
        elif section == "v1":
            report += await section_v1(args, http)
        elif section == "relay":
            report += await section_relay(args, triton, http)
        report.append("")
        print("\n".join(report), flush=True)  # partial results survive an interrupted run
    await http.close()
    await triton.close()
    return "\n".join(report)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"some of {','.join(SECTIONS)}")
    parser.add_argument("--rates", default="50,200", help="arrival rates, req/s")
    parser.add_argument("--slice", type=float, default=4.0, help="seconds per mode per round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients for the throughput test")
    parser.add_argument("--ttft-samples", type=int, default=30)
    parser.add_argument("--streams", type=int, default=200, help="concurrent streams for the relay test")
    parser.add_argument("--stream-tokens", type=int, default=100)
    parser.add_argument("--model", default="clip_text", choices=sorted(INPUTS))
    parser.add_argument("--workers", type=int, default=1, help="gateway processes of the stack it starts")
    parser.add_argument("--gateway-url", help="use a running gateway (with --triton-url) instead of starting a stack")
    parser.add_argument("--triton-url")
    parser.add_argument("--api-key", default="", help="with --gateway-url")
    parser.add_argument("--json", help="also write the report here")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    args.sections = [s for s in args.sections.split(",") if s]
    if args.gateway_url and args.triton_url:
        report = asyncio.run(run(args, args.gateway_url, args.triton_url, args.api_key))
    else:
        # The relay runs every stream at once: the gateway may keep that many on one replica.
        inflight = str(max(32, args.streams + 8))
        with local_stack(gateway_workers=args.workers, REPLICA_MAX_INFLIGHT=inflight) as endpoints:
            assert endpoints.stack is not None
            os.environ["LLM_MODEL_DIR"] = endpoints.stack.service_env["LLM_MODEL_DIR"]
            report = asyncio.run(run(args, endpoints.gateway, endpoints.triton_grpc, endpoints.api_key))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"report": report}, out)


if __name__ == "__main__":
    main()
