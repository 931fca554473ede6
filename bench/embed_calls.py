"""A unary `ModelInfer` call a batch (what the gateway's shared Triton calls make,
gateway/server/replicas/batching.py) against one long-lived `stream_infer` carrying
every batch as a message, responses told apart by their request id (issue 30: "measure
... and keep the cheaper"). The same `clip_text` requests, 64 batches in flight, on
uvloop as the gateway runs; the client's CPU (this process, all threads: gRPC's
included) per request, in alternating rounds.

Run:  .venv/bin/python -m bench.embed_calls                        (starts its own stack)
      .venv/bin/python -m bench.embed_calls --requests 3000 --rounds 3 --batches 1,4,16
      .venv/bin/python -m bench.embed_calls --triton-url 127.0.0.1:8001   (a running stack)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import numpy as np
import tritonclient.grpc.aio as triton_aio
import uvloop
from tritonclient.grpc import InferInput, InferRequestedOutput

from bench.stack import local_stack

MODEL, INPUT, OUTPUT = "clip_text", "text", "text_embeds"
TEXT = b"a photo of a cat sitting on a mat"
IN_FLIGHT = 64

Mode = Callable[[triton_aio.InferenceServerClient, int, int], Awaitable[float]]


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def batch_of(size: int) -> list[InferInput]:
    rows = InferInput(INPUT, [size, 1], "BYTES")
    rows.set_data_from_numpy(np.array([[TEXT]] * size, dtype=np.object_))
    return [rows]


def rows_in(result: Any, size: int) -> None:
    if result.as_numpy(OUTPUT).shape[0] != size:
        raise RuntimeError(f"{MODEL} answered {result.as_numpy(OUTPUT).shape[0]} rows for {size}")


async def unary(client: triton_aio.InferenceServerClient, requests: int, size: int) -> float:
    """A call a batch; the client's CPU µs a request."""
    slots = asyncio.Semaphore(IN_FLIGHT)
    outputs = [InferRequestedOutput(OUTPUT)]

    async def one() -> None:
        async with slots:
            rows_in(await client.infer(MODEL, batch_of(size), outputs=outputs, client_timeout=60), size)

    began = cpu_s()
    await asyncio.gather(*(one() for _ in range(requests // size)))
    return (cpu_s() - began) / requests * 1e6


async def shared(client: triton_aio.InferenceServerClient, requests: int, size: int) -> float:
    """Every batch a message of one stream; the client's CPU µs a request."""
    loop = asyncio.get_running_loop()
    outbox: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    waiting: dict[str, asyncio.Future[None]] = {}
    outputs = [InferRequestedOutput(OUTPUT)]

    async def messages() -> AsyncIterator[dict[str, Any]]:
        while (message := await outbox.get()) is not None:
            yield message

    async def read() -> None:
        async for result, error in client.stream_infer(messages()):
            if error is not None:
                raise error
            rows_in(result, size)
            waiting.pop(result.get_response().id).set_result(None)

    reader = asyncio.create_task(read())
    slots = asyncio.Semaphore(IN_FLIGHT)

    async def one() -> None:
        async with slots:
            request_id = uuid.uuid4().hex
            answer = waiting[request_id] = loop.create_future()
            message = {"model_name": MODEL, "inputs": batch_of(size), "outputs": outputs, "request_id": request_id}
            outbox.put_nowait(message)
            await answer

    began = cpu_s()
    try:
        await asyncio.gather(*(one() for _ in range(requests // size)))
        return (cpu_s() - began) / requests * 1e6
    finally:
        outbox.put_nowait(None)
        reader.cancel()
        with contextlib.suppress(BaseException):
            await reader


async def run(args: argparse.Namespace, url: str) -> str:
    client = triton_aio.InferenceServerClient(url)
    modes: dict[str, Mode] = {"a unary call a batch": unary, "one shared stream_infer": shared}
    sizes = [int(s) for s in args.batches.split(",")]
    seen: dict[tuple[str, int], list[float]] = {(name, size): [] for name in modes for size in sizes}
    try:
        for mode in modes.values():  # warm both paths
            await mode(client, 256, 1)
        for _ in range(args.rounds):
            for size in sizes:
                for name, mode in modes.items():
                    began = time.perf_counter()
                    seen[name, size].append(await mode(client, args.requests, size))
                    seen[name, size].append(args.requests / (time.perf_counter() - began))
    finally:
        await client.close()
    lines = [
        f"`{MODEL}`, {args.requests} requests a round in batches of N, {IN_FLIGHT} batches in flight, "
        f"{args.rounds} rounds, alternating; the client process's CPU (all threads):",
        "",
        "| batch rows | mode | client CPU µs a request (each round) | median | req/s (median) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for (name, size), values in seen.items():
        cpu, rate = values[0::2], values[1::2]
        lines.append(
            f"| {size} | {name} | {' / '.join(f'{v:.0f}' for v in cpu)} | {statistics.median(cpu):.0f} "
            f"| {statistics.median(rate):,.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-url", help="a running stack's Triton gRPC (host:port); else one is started")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", default="1,4,16", help="rows a call (clip_text takes at most 16)")
    args = parser.parse_args()
    if args.triton_url:
        print(uvloop.run(run(args, args.triton_url)))
        return
    with local_stack() as endpoints:
        print(uvloop.run(run(args, endpoints.triton_grpc)))


if __name__ == "__main__":
    main()
