"""Where a request's time goes, stage by stage, from its OpenTelemetry trace (issue 50).

Starts the local stack with tracing exported over OTLP/HTTP to a collector in this process
(gateway.common.tracing), sends streamed requests of the synthetic engine (POST /infer
with Accept: text/event-stream, each with a traceparent of its own), and prints the median
duration of each stage's span: at 1, 8 and 32 stream starts sent at once, and in an open
loop at 150 requests/s. `first byte (client)` is this client's time to the first token
event (from sending the request); `total (client)` to the end of the stream.

The stages (spans, gateway.common.tracing): accept (validation, token counting, quotas,
SUBMIT), accept.tokenize, accept.quotas, submit, start (submission until a process started
it), run, replica.call, replica.first_response (the call until Triton's first response),
emit.first_event (the call until the first token event is in Redis), finish, binder.store
(read from the results stream until stored and acknowledged). A stage's share of `first
byte (client)` not in these spans is the SSE hub reading the event and the HTTP send.

Run:  .venv/bin/python -m bench.trace_breakdown                 (its own stack; a few minutes)
      .venv/bin/python -m bench.trace_breakdown --rounds 1 --seconds 1 --starts 1,8   (a smoke run)
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import os
import secrets
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from bench.gateway_bench import STREAM_MODEL
from bench.stack import ROOT, local_stack
from gateway.stack.process import free_port

STAGES = [
    "accept",
    "accept.tokenize",
    "accept.quotas",
    "submit",
    "start",
    "run",
    "replica.call",
    "replica.first_response",
    "emit.first_event",
    "finish",
    "binder.store",
]
TERMINAL_EVENTS = ("completed", "failed", "canceled", "expired")


@dataclass
class Collector:
    """An OTLP/HTTP endpoint (protobuf at /v1/traces): span durations (ms) by trace id and name."""

    port: int = field(default_factory=free_port)
    durations: dict[str, dict[str, float]] = field(default_factory=lambda: defaultdict(dict))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if (b"content-encoding", b"gzip") in scope["headers"]:
            body = gzip.decompress(body)
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        for resource_spans in request.resource_spans:
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    ms = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e6
                    self.durations[span.trace_id.hex()][span.name] = ms
        headers = [(b"content-type", b"application/x-protobuf")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": ExportTraceServiceResponse().SerializeToString()})

    async def wait(self, trace_ids: list[str], timeout: float = 30) -> None:
        """Until every trace has its last stages (or the timeout: what came is reported)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all({"finish", "binder.store"} <= self.durations[t].keys() for t in trace_ids):
                return
            await asyncio.sleep(0.1)


@dataclass
class Sample:
    trace_id: str
    first_byte_ms: float | None = None
    total_ms: float | None = None
    error: str | None = None


async def stream(session: aiohttp.ClientSession, gateway: str, tokens: int) -> Sample:
    """One streamed request, traced under a trace id of its own."""
    sample = Sample(trace_id=secrets.token_hex(16))
    headers = {"Accept": "text/event-stream", "traceparent": f"00-{sample.trace_id}-{secrets.token_hex(8)}-01"}
    body = {"model": STREAM_MODEL, "inputs": {"text_input": "Hello world, the gateway", "max_tokens": tokens}}
    began = time.perf_counter()
    event = ""
    try:
        async with session.post(f"{gateway}/infer", json={**body, "stream": True}, headers=headers) as response:
            if response.status >= 400:
                sample.error = f"HTTP {response.status}"
                return sample
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("event:"):
                    event = line.split(":", 1)[1].strip()
                elif line.startswith("data:") and event == "token" and sample.first_byte_ms is None:
                    sample.first_byte_ms = (time.perf_counter() - began) * 1000
                elif line.startswith("data:") and event in TERMINAL_EVENTS:
                    if event != "completed":
                        sample.error = event
                    break
    except aiohttp.ClientError as exc:
        sample.error = type(exc).__name__
    sample.total_ms = (time.perf_counter() - began) * 1000
    return sample


async def starts(session: aiohttp.ClientSession, gateway: str, n: int, rounds: int, tokens: int) -> list[Sample]:
    """n streams started at once, `rounds` times (one round after the other)."""
    samples: list[Sample] = []
    for _ in range(rounds):
        samples += await asyncio.gather(*(stream(session, gateway, tokens) for _ in range(n)))
    return samples


async def open_loop(
    session: aiohttp.ClientSession, gateway: str, rate: float, seconds: float, tokens: int
) -> list[Sample]:
    """Requests leave on schedule, whatever the earlier ones are doing."""
    tasks = []
    began = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = began + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(stream(session, gateway, tokens)))
    return list(await asyncio.gather(*tasks))


def median(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def table(columns: dict[str, list[Sample]], collector: Collector) -> list[str]:
    names = list(columns)
    lines = [
        "| stage (median ms) | " + " | ".join(names) + " |",
        "|---" * (len(names) + 1) + "|",
    ]
    for stage in STAGES:
        cells = []
        for samples in columns.values():
            cells.append(
                median(
                    [
                        collector.durations[s.trace_id][stage]
                        for s in samples
                        if stage in collector.durations[s.trace_id]
                    ]
                )
            )
        lines.append(f"| {stage} | " + " | ".join(cells) + " |")
    for label, attr in (("first byte (client)", "first_byte_ms"), ("total (client)", "total_ms")):
        cells = [
            median([getattr(s, attr) for s in samples if getattr(s, attr) is not None and s.error is None])
            for samples in columns.values()
        ]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    counts = [f"{len(samples)} ({sum(s.error is not None for s in samples)} failed)" for samples in columns.values()]
    lines.append("| requests | " + " | ".join(counts) + " |")
    return lines


async def measure(args: argparse.Namespace, gateway: str, api_key: str, collector: Collector) -> list[str]:
    server = uvicorn.Server(
        uvicorn.Config(collector, host="127.0.0.1", port=collector.port, log_level="warning", lifespan="off")
    )
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    columns: dict[str, list[Sample]] = {}
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    try:
        async with aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {api_key}"}, connector=connector, timeout=timeout
        ) as session:
            await starts(session, gateway, 1, 2, args.tokens)  # warm: connections, the first tokenizer call
            for n in args.starts:
                columns[f"{n} at once"] = await starts(session, gateway, n, args.rounds, args.tokens)
            for rate in args.rates:
                columns[f"{rate:g} req/s"] = await open_loop(session, gateway, rate, args.seconds, args.tokens)
        await collector.wait([s.trace_id for samples in columns.values() for s in samples])
    finally:
        server.should_exit = True
        await serving
    return table(columns, collector)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--starts", default="1,8,32", help="stream starts sent at once (comma separated)")
    parser.add_argument("--rates", default="150", help="open-loop rates, requests/s (comma separated)")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each burst of starts")
    parser.add_argument("--seconds", type=float, default=10, help="seconds of each open-loop rate")
    parser.add_argument("--tokens", type=int, default=8, help="max_tokens of each request (20 ms a token)")
    parser.add_argument("--workers", type=int, default=1, help="gateway processes")
    args = parser.parse_args()
    args.starts = [int(n) for n in args.starts.split(",") if n]
    args.rates = [float(r) for r in args.rates.split(",") if r]
    collector = Collector()
    env = {
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://127.0.0.1:{collector.port}/v1/traces",
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_BSP_MAX_QUEUE_SIZE": "65536",  # no span dropped at 150 req/s
    }
    with local_stack(ROOT / ".stack-bench", gateway_workers=args.workers, **env) as stack:
        lines = asyncio.run(measure(args, stack.gateway, stack.api_key, collector))
    print(f"Model `{STREAM_MODEL}`, {args.tokens} tokens a request, {os.cpu_count()} CPUs, ", end="")
    print(f"{args.workers} gateway process(es)")
    print("\n".join(lines))
    print(json.dumps({"starts": args.starts, "rates": args.rates, "rounds": args.rounds, "seconds": args.seconds}))


if __name__ == "__main__":
    main()
