"""Gateway benchmark: the same model and load, side by side in one run, over
  direct   tritonclient.grpc.aio straight to Triton (the baseline),
  sync     POST /infer with `Prefer: wait` (200 with the result),
  async    POST /infer (202), then GET /results/<id>?wait until it is ready.

1. Open loop at fixed arrival rates: requests leave on schedule whatever the answers do
   (latency counts from the scheduled send, so a stall is not hidden). Modes alternate
   in short slices, rounds repeated, so machine noise hits all of them alike.
2. Throughput: closed loop, a fixed number of concurrent clients per mode.
3. Streaming: time to first token, direct gRPC stream vs POST + SSE through the gateway.

The HTTP load comes from aiohttp, a lighter client than httpx, so that the client's own
cost on this small machine is not counted as gateway overhead.

Run:  .venv/bin/python -m bench.gateway_bench            (starts its own local stack)
      .venv/bin/python -m bench.gateway_bench --rates 100,200 --slice 5 --rounds 3 --model llm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp
import numpy as np
import tritonclient.grpc.aio as triton_aio
from gateway.adapters import ADAPTERS

from bench.stack import local_stack

LLM_INPUTS = {"text_input": "Hello world, the gateway", "max_tokens": 32}
INPUTS = {
    "clip_text": {"text": "a photo of a cat sitting on a mat"},
    "text_embed": {"text": "a cat sits on the mat"},
    "llm": {"text_input": "Hello world, the gateway", "max_tokens": 16},
}


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
        return float(np.percentile(self.latencies, q)) * 1000 if self.latencies else float("nan")

    @property
    def rate(self) -> float:
        return len(self.latencies) / self.ended if self.ended else 0.0


Call = Callable[[], Awaitable[None]]


def direct_call(client: triton_aio.InferenceServerClient, model: str, inputs: dict) -> Call:
    adapter = ADAPTERS[model]
    parsed, params = adapter.validate(inputs, {})

    async def call() -> None:
        inputs = adapter.triton_inputs(parsed, params, False)
        if not adapter.decoupled:
            await client.infer(model, inputs, outputs=adapter.requested_outputs())
            return
        async for _, error in client.stream_infer(_once({"model_name": model, "inputs": inputs})):
            if error:
                raise error

    return call


async def _once(request: dict):
    yield request


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


async def ttft_direct(client: triton_aio.InferenceServerClient) -> float:
    adapter = ADAPTERS["llm"]
    parsed, params = adapter.validate(LLM_INPUTS, {})
    request = {
        "model_name": "llm",
        "inputs": adapter.triton_inputs(parsed, params, True),
        "outputs": adapter.requested_outputs(),
    }
    began = time.perf_counter()
    first = None
    async for _, error in client.stream_infer(_once(request)):
        if error:
            raise error
        first = first or time.perf_counter() - began
    return first


async def ttft_gateway(http: aiohttp.ClientSession) -> float:
    """POST with Accept: text/event-stream: the events come back on the submit itself."""
    began = time.perf_counter()
    first = None
    body = {"model": "llm", "inputs": LLM_INPUTS, "stream": True}
    async with http.post("/infer", json=body, headers={"Accept": "text/event-stream"}) as events:
        async for raw in events.content:
            line = raw.decode().strip()
            if line == "event: token" and first is None:
                first = time.perf_counter() - began
            if line == "event: completed":
                break
    return first


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


async def run(args: argparse.Namespace, gateway_url: str, triton_url: str) -> str:
    triton = triton_aio.InferenceServerClient(triton_url)
    http = aiohttp.ClientSession(
        gateway_url, connector=aiohttp.TCPConnector(limit=512), timeout=aiohttp.ClientTimeout(total=60)
    )
    calls = {
        "direct": direct_call(triton, args.model, INPUTS[args.model]),
        "sync": sync_call(http, args.model, INPUTS[args.model]),
        "async": async_call(http, args.model, INPUTS[args.model]),
    }
    for call in calls.values():  # warm up every path
        await closed_loop(call, 8, 2)

    lines = [
        f"Model `{args.model}`, open loop, {args.rounds} rounds x {args.slice:g} s per mode and rate "
        "(latency from the scheduled send).",
        "",
        row(
            "rate (req/s)",
            "mode",
            "requests",
            "errors",
            "achieved req/s",
            "p50 ms",
            "p90 ms",
            "p99 ms",
            "added p50 ms",
            "added p99 ms",
        ),
        row(*["---"] * 10),
    ]
    for rate in args.rates:
        totals = {mode: Samples() for mode in calls}
        for _ in range(args.rounds):
            for mode, call in calls.items():
                totals[mode].add(await open_loop(call, rate, args.slice))
        base = totals["direct"]
        for mode, s in totals.items():
            added = (
                ("", "")
                if mode == "direct"
                else (f"{s.pct(50) - base.pct(50):+.2f}", f"{s.pct(99) - base.pct(99):+.2f}")
            )
            lines.append(
                row(
                    rate,
                    mode,
                    len(s.latencies),
                    s.errors,
                    f"{s.rate:.0f}",
                    f"{s.pct(50):.2f}",
                    f"{s.pct(90):.2f}",
                    f"{s.pct(99):.2f}",
                    *added,
                )
            )

    lines += [
        "",
        f"Throughput, closed loop with {args.clients} concurrent clients, {args.rounds} x {args.slice:g} s per mode:",
        "",
        row("mode", "requests", "errors", "req/s", "p50 ms", "p99 ms", "vs direct"),
        row(*["---"] * 7),
    ]
    totals = {mode: Samples() for mode in calls}
    for _ in range(args.rounds):
        for mode, call in calls.items():
            totals[mode].add(await closed_loop(call, args.clients, args.slice))
    for mode, s in totals.items():
        lines.append(
            row(
                mode,
                len(s.latencies),
                s.errors,
                f"{s.rate:.0f}",
                f"{s.pct(50):.2f}",
                f"{s.pct(99):.2f}",
                f"{s.rate / totals['direct'].rate:.0%}",
            )
        )

    direct_ttft, gateway_ttft = [], []
    for _ in range(args.ttft_samples):
        direct_ttft.append(await ttft_direct(triton))
        gateway_ttft.append(await ttft_gateway(http))
    d, g = statistics.median(direct_ttft) * 1000, statistics.median(gateway_ttft) * 1000
    lines += [
        "",
        f"Time to first token, llm (demo model), {args.ttft_samples} sequential requests each, alternating:",
        "",
        row("path", "median TTFT ms", "p90 ms"),
        row("---", "---", "---"),
        row("direct gRPC stream_infer", f"{d:.2f}", f"{np.percentile(direct_ttft, 90) * 1000:.2f}"),
        row("gateway POST, events in the answer (SSE)", f"{g:.2f}", f"{np.percentile(gateway_ttft, 90) * 1000:.2f}"),
        "",
        f"SSE TTFT added by the gateway: {g - d:+.2f} ms (median)",
    ]
    await http.close()
    await triton.close()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="50,100,200", help="arrival rates, req/s")
    parser.add_argument("--slice", type=float, default=4.0, help="seconds per mode per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients for the throughput test")
    parser.add_argument("--ttft-samples", type=int, default=30)
    parser.add_argument("--model", default="clip_text", choices=sorted(INPUTS))
    parser.add_argument("--gateway-url", help="use a running gateway (with --triton-url) instead of starting a stack")
    parser.add_argument("--triton-url")
    parser.add_argument("--json", help="also write the raw table here")
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",")]
    if args.gateway_url and args.triton_url:
        report = asyncio.run(run(args, args.gateway_url, args.triton_url))
    else:
        with local_stack() as endpoints:
            report = asyncio.run(run(args, endpoints.gateway, endpoints.triton_grpc))
    print(report)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"report": report}, out)


if __name__ == "__main__":
    main()
