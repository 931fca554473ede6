"""Time to first token at 1/8/32 concurrent stream starts against a running stack, four paths
alternating in each round: direct gRPC `stream_infer` (tritonclient.grpc.aio), `POST /infer` with
SSE (aiohttp), `/v1/chat/completions` streamed (aiohttp) and the same by the official `openai`
client (AsyncOpenAI, as issue 50's TTFT figures were taken); the gateway's CPU a stream on each
gateway path (utime + stime of its processes over the path's bursts, whole 32-token streams),
and its CPU a stream start (bursts of 32 one-token streams). bench.gateway_bench's tracers,
prompt and `llm_synthetic` inputs.

Run:  python -m bench.ttft_openai --gateway-url http://127.0.0.1:8080 --triton-url 127.0.0.1:8001 \
          --api-key "$(cat .stack/api_key)" --samples 12 --start-bursts 6"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

import tritonclient.grpc.aio as triton_aio
from openai import AsyncOpenAI

from bench.gateway_bench import (
    CHAT,
    STREAM_INPUTS,
    STREAM_MODEL,
    Gateways,
    StreamTrace,
    pct,
    row,
    trace_chat_stream,
    trace_direct,
    trace_sse,
)


async def trace_openai(client: AsyncOpenAI, max_tokens: int) -> StreamTrace:
    trace = StreamTrace(began=time.perf_counter(), expected=max_tokens)
    stream = await client.chat.completions.create(
        model=STREAM_MODEL, messages=cast(Any, CHAT), max_tokens=max_tokens, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            trace.arrivals.append(time.perf_counter())
            trace.tokens += 1
    return trace


async def _burst(
    http: Gateways, start: Callable[[dict[str, Any]], Awaitable[StreamTrace]], inputs: dict[str, Any], count: int
) -> tuple[float, list[float], list[Any]]:
    """`count` streams started at once: the gateway's CPU meanwhile, the TTFTs of those that
    streamed, and the others (their exception or token-less trace)."""
    before = http.cpu_seconds()
    traces = await asyncio.gather(*(start(inputs) for _ in range(count)), return_exceptions=True)
    spent = http.cpu_seconds() - before
    streamed = [t for t in traces if isinstance(t, StreamTrace) and t.arrivals]
    return spent, [t.ttft for t in streamed], [t for t in traces if not any(t is s for s in streamed)]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gateway-url", required=True)
    p.add_argument("--triton-url", required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument(
        "--samples", type=int, default=24, help="streams sampled per path and concurrency (at least 3 rounds)"
    )
    p.add_argument("--start-bursts", type=int, default=6, help="bursts of 32 one-token streams for CPU a start")
    a = p.parse_args()
    triton = triton_aio.InferenceServerClient(a.triton_url)
    http = Gateways([a.gateway_url], a.api_key)
    oai = AsyncOpenAI(base_url=a.gateway_url + "/v1", api_key=a.api_key, max_retries=0, timeout=120)
    tokens = STREAM_INPUTS["max_tokens"]
    starts = {
        "direct gRPC stream_infer": lambda inp: trace_direct(triton, inp),
        "POST /infer SSE (aiohttp)": lambda inp: trace_sse(http, inp),
        "/v1 stream (aiohttp)": lambda inp: trace_chat_stream(http, inp["max_tokens"]),
        "/v1 stream (openai client)": lambda inp: trace_openai(oai, inp["max_tokens"]),
    }
    print(
        f"TTFT, `{STREAM_MODEL}`, {tokens} tokens a stream, paths alternating within each round; "
        "gateway CPU ms a stream over the bursts (whole streams):\n"
    )
    print(
        row(
            "concurrent starts",
            "path",
            "streams",
            "errors",
            "TTFT p50 ms",
            "p90 ms",
            "p99 ms",
            "added p50 ms",
            "added p90 ms",
            "gateway CPU ms/stream",
        )
    )
    print(row(*["---"] * 10))
    for n in [int(s) for s in a.streams.split(",")]:
        for start in starts.values():  # warm up the connections at this concurrency
            await asyncio.gather(*(start(STREAM_INPUTS) for _ in range(n)), return_exceptions=True)
        rounds = max(3, a.samples // n)
        ttft: dict[str, list[float]] = {k: [] for k in starts}
        cpu = {k: 0.0 for k in starts}
        errs = {k: 0 for k in starts}
        for _ in range(rounds):
            for key, start in starts.items():
                spent, ttfts, failed = await _burst(http, start, STREAM_INPUTS, n)
                cpu[key] += spent
                ttft[key] += ttfts
                for t in failed[: max(0, 2 - errs[key])]:
                    print(f"<!-- {key}: {t!r:.300} -->")
                errs[key] += len(failed)
        base50 = statistics.median(ttft["direct gRPC stream_infer"]) * 1000
        base90 = pct(ttft["direct gRPC stream_infer"], 90)
        for key, values in ttft.items():
            m = statistics.median(values) * 1000 if values else float("nan")
            gw = key != "direct gRPC stream_infer"
            print(
                row(
                    n,
                    key,
                    len(values),
                    errs[key],
                    f"{m:.2f}",
                    f"{pct(values, 90):.2f}",
                    f"{pct(values, 99):.2f}",
                    f"{m - base50:+.2f}" if gw else "",
                    f"{pct(values, 90) - base90:+.2f}" if gw else "",
                    f"{cpu[key] * 1000 / (rounds * n):.2f}" if gw else "",
                ),
                flush=True,
            )
    # CPU per stream start: bursts of 32 streams of one token (start, one token, finish).
    one = {**STREAM_INPUTS, "max_tokens": 1}
    print(f"\nCPU per stream start: {a.start_bursts} bursts of 32 one-token streams per path, alternating:\n")
    print(row("path", "streams", "errors", "TTFT p50 ms", "gateway CPU ms/stream"))
    print(row(*["---"] * 5))
    cpu = {k: 0.0 for k in starts}
    ttft = {k: [] for k in starts}
    errs = {k: 0 for k in starts}
    for _ in range(a.start_bursts):
        for key, start in starts.items():
            spent, ttfts, failed = await _burst(http, start, one, 32)
            cpu[key] += spent
            ttft[key] += ttfts
            errs[key] += len(failed)
    for key in starts:
        gw = key != "direct gRPC stream_infer"
        m = statistics.median(ttft[key]) * 1000 if ttft[key] else float("nan")
        print(
            row(
                key,
                len(ttft[key]),
                errs[key],
                f"{m:.2f}",
                f"{cpu[key] * 1000 / (32 * a.start_bursts):.2f}" if gw else "",
            )
        )
    await http.close()
    await oai.close()
    await triton.close()


if __name__ == "__main__":
    asyncio.run(main())
