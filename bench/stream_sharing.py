"""One gRPC stream a request against one long-lived stream carrying many (issue 30): the
client's CPU for the same generations through Triton's decoupled `stream_infer`, either
as the gateway runs them (a `stream_infer` call a request, closed when it ends) or
multiplexed (every request written into one bidirectional stream, responses told apart
by their request id). Measured on the synthetic engine, in alternating rounds, as CPU of
this process (all its threads: gRPC's included) per token and per request, with tokens/s
and the time to first token.

Run:  .venv/bin/python -m bench.stream_sharing                      (starts its own stack)
      .venv/bin/python -m bench.stream_sharing --streams 200 --tokens 100 --rounds 3
      .venv/bin/python -m bench.stream_sharing --triton-url 127.0.0.1:8001   (a running stack)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc.aio as triton_aio

from bench.gateway_bench import STREAM_MODEL, adapter
from bench.stack import local_stack


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@dataclass
class Round:
    tokens: int = 0
    requests: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0
    ttft: list[float] = field(default_factory=list)


def request_for(tokens: int) -> dict[str, Any]:
    """The engine request the gateway sends for a generation of `tokens` tokens."""
    model = adapter(STREAM_MODEL)
    run = model.new_run(model.validate({"text_input": "Hello world, the gateway", "max_tokens": tokens}, {}))
    return {"model_name": run.triton_model, "inputs": run.inputs(True), "outputs": run.outputs()}


def tokens_in(result: Any) -> int:
    lengths = result.as_numpy("sequence_length")
    if lengths is not None:
        return int(lengths.reshape(-1)[0])
    ids = result.as_numpy("output_ids")
    return 0 if ids is None else int(ids.size)


async def per_request(
    client: triton_aio.InferenceServerClient, request: dict[str, Any], streams: int, tokens: int
) -> Round:
    """A stream_infer call a request (the gateway's runner)."""
    out = Round(requests=streams)

    async def one() -> None:
        began = time.perf_counter()
        got = 0

        async def once() -> AsyncIterator[dict[str, Any]]:
            yield {**request, "request_id": uuid.uuid4().hex}

        async for result, error in client.stream_infer(once()):
            if error is not None:
                raise error
            if got == 0:
                out.ttft.append(time.perf_counter() - began)
            got += tokens_in(result)
            if got >= tokens:
                break
        out.tokens += got

    began, cpu = time.perf_counter(), cpu_s()
    await asyncio.gather(*(one() for _ in range(streams)))
    out.wall_s, out.cpu_s = time.perf_counter() - began, cpu_s() - cpu
    return out


async def shared(client: triton_aio.InferenceServerClient, request: dict[str, Any], streams: int, tokens: int) -> Round:
    """Every request written into one stream_infer call; responses told apart by id."""
    out = Round(requests=streams)
    ids = [uuid.uuid4().hex for _ in range(streams)]
    got = dict.fromkeys(ids, 0)
    sent: dict[str, float] = {}
    ended = asyncio.Event()

    async def requests() -> AsyncIterator[dict[str, Any]]:
        for request_id in ids:
            sent[request_id] = time.perf_counter()
            yield {**request, "request_id": request_id}
        await ended.wait()  # the stream stays open until every generation has ended

    began, cpu = time.perf_counter(), cpu_s()
    left = streams
    async for result, error in client.stream_infer(requests()):
        if error is not None:
            raise error
        request_id = result.get_response().id
        if got[request_id] == 0:
            out.ttft.append(time.perf_counter() - sent[request_id])
        before = got[request_id]
        got[request_id] += tokens_in(result)
        if before < tokens <= got[request_id]:
            left -= 1
            if left == 0:
                ended.set()
                break
    out.wall_s, out.cpu_s = time.perf_counter() - began, cpu_s() - cpu
    out.tokens = sum(got.values())
    return out


async def run(args: argparse.Namespace, url: str) -> str:
    client = triton_aio.InferenceServerClient(url)
    request = request_for(args.tokens)
    modes = {"a stream a request": per_request, "one shared stream": shared}
    totals = {name: Round() for name in modes}
    try:
        for mode in modes.values():  # warm both paths
            await mode(client, request, 4, min(args.tokens, 8))
        for _ in range(args.rounds):
            for name, mode in modes.items():
                got = await mode(client, request, args.streams, args.tokens)
                total = totals[name]
                total.tokens += got.tokens
                total.requests += got.requests
                total.cpu_s += got.cpu_s
                total.wall_s += got.wall_s
                total.ttft += got.ttft
    finally:
        await client.close()
    lines = [
        f"`{STREAM_MODEL}`, {args.streams} concurrent generations of {args.tokens} tokens, {args.rounds} rounds "
        "a mode, alternating; CPU of the client process (all threads):",
        "",
        "| mode | tokens/s | client CPU µs a token | client CPU µs a request | TTFT p50 ms |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, total in totals.items():
        lines.append(
            f"| {name} | {total.tokens / total.wall_s:,.0f} | {total.cpu_s * 1e6 / max(1, total.tokens):.1f} "
            f"| {total.cpu_s * 1e6 / max(1, total.requests):.0f} | {statistics.median(total.ttft) * 1000:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-url", help="a running stack's Triton gRPC (host:port); else one is started")
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.triton_url:
        print(asyncio.run(run(args, args.triton_url)))
        return
    with local_stack() as endpoints:
        assert endpoints.stack is not None
        os.environ.setdefault("LLM_MODEL_DIR", endpoints.stack.service_env["LLM_MODEL_DIR"])
        print(asyncio.run(run(args, endpoints.triton_grpc)))


if __name__ == "__main__":
    main()
