"""Where a request waits when a gateway process is offered more than it can serve (issue
60, item 11): the kernel's accept queue, the process before its edge (uvicorn's accepted
connections and the loop's ready queue), or inside the edge (the app's stages: key,
body, validation, the tokenize pool, SUBMIT, the run, the answer).

An open loop at fixed rates against a gateway process of the stack as `make up` starts
it (bench.stack: one process, LOG_LEVEL WARNING so that the access lines are not the
load), the load of the outage campaign that showed the wait: 90% single-input
`clip_text` POST /infer with `Prefer: wait`, 10% 16-input `/v1/embeddings` of
`text_embed`. Requests leave on schedule whatever the answers do. Every 100 ms a
sampler thread reads, at the same instant:
  outstanding   requests the client has sent and not had answered;
  accept queue  connections the kernel holds for the gateway's listening socket and the
                gateway has not accepted (`ss`: a listening socket's Recv-Q);
  in the edge   requests the gateway's edge has begun and not yet answered
                (gateway_http_inflight on /metrics, asked on a connection of its own);
  probe         how long that /metrics answer took: what a new connection waits before
                its first step (the accept queue, then the loop);
  loop lag      the gateway's own reading of how far behind its loop runs
                (gateway_event_loop_lag_seconds: its own work, not the OS's waits).
outstanding - accept queue - in the edge is what is accepted and not yet in the edge.

Each answered POST /infer also splits its own time by its record's timestamps: send ->
created_at (everything before SUBMIT), created -> finished (the run), finished -> the
client has the answer. And each rate says how the answers went (200, 429, 503) and how
fast a refusal came.

Run:  .venv/bin/python -m bench.overload_wait                       (rates 10,25,50)
      .venv/bin/python -m bench.overload_wait --rates 25 --seconds 20 --max-inflight 64
--max-inflight sets MAX_INFLIGHT_REQUESTS on the gateway (the stack's default otherwise)
and is printed with the figures: it is a setting `make up` does not change.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import re
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from urllib.parse import urlsplit

import aiohttp

from bench.cpu import ProcessCpu
from bench.stack import local_stack

EMBED_TEXTS = [f"an overload sample text number {n} about nothing in particular" for n in range(16)]


@dataclass
class Sample:
    at: float
    outstanding: int
    accept_queue: int
    in_edge: float
    probe_ms: float
    lag_ms: float


@dataclass
class Answer:
    kind: str
    status: int
    sent: float
    answered: float
    created: float | None = None
    finished: float | None = None


@dataclass
class Run:
    rate: float
    answers: list[Answer] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    outstanding: int = 0
    gateway_cores: float = 0.0  # the gateway's CPU seconds over the run's wall seconds


def _accept_queue(port: int) -> int:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=False).stdout
    queued = [int(line.split()[1]) for line in out.splitlines() if line.split()]
    return sum(queued)


_INFLIGHT = re.compile(rb"^gateway_http_inflight(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)
_LAG = re.compile(rb"^gateway_event_loop_lag_seconds(?:\{[^}]*\})? ([0-9.e+-]+)$", re.MULTILINE)


def _sampler(run: Run, host: str, port: int, stop: threading.Event) -> None:
    while not stop.is_set():
        at = time.monotonic()
        queued = _accept_queue(port)
        outstanding = run.outstanding
        began = time.perf_counter()
        in_edge = lag_ms = float("nan")
        try:
            conn = http.client.HTTPConnection(host, port, timeout=30)
            conn.request("GET", "/metrics")
            body = conn.getresponse().read()
            conn.close()
            found = _INFLIGHT.search(body)
            in_edge = float(found.group(1)) if found else float("nan")
            lagging = _LAG.search(body)
            lag_ms = float(lagging.group(1)) * 1e3 if lagging else float("nan")
        except OSError:
            pass
        probe_ms = (time.perf_counter() - began) * 1e3
        run.samples.append(Sample(at, outstanding, queued, in_edge, probe_ms, lag_ms))
        stop.wait(max(0.0, 0.1 - (time.monotonic() - at)))


def _stamp(value: str | None) -> float | None:
    return datetime.fromisoformat(value).timestamp() if value else None


async def _one(session: aiohttp.ClientSession, url: str, key: str, kind: str, run: Run) -> None:
    headers = {"Authorization": f"Bearer {key}"}
    if kind == "infer":
        target, body = f"{url}/infer", {"model": "clip_text", "inputs": {"text": "an overload probe"}}
        headers["Prefer"] = "wait=60"
    else:
        target, body = f"{url}/v1/embeddings", {"model": "text_embed", "input": EMBED_TEXTS}
    sent = time.time()
    run.outstanding += 1
    answer = Answer(kind, 0, sent, 0.0)
    try:
        async with session.post(target, json=body, headers=headers) as response:
            answer.status = response.status
            data = await response.json(content_type=None) if response.status == 200 else None
        if kind == "infer" and isinstance(data, dict):
            answer.created, answer.finished = _stamp(data.get("created_at")), _stamp(data.get("finished_at"))
    except (TimeoutError, aiohttp.ClientError):
        answer.status = -1
    finally:
        run.outstanding -= 1
        answer.answered = time.time()
        run.answers.append(answer)


async def _offer(url: str, key: str, rate: float, seconds: float) -> Run:
    run = Run(rate)
    parts = urlsplit(url)
    stop = threading.Event()
    sampler = threading.Thread(target=_sampler, args=(run, parts.hostname, parts.port, stop), daemon=True)
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=180)
    cpu = ProcessCpu.of_urls([url])
    cpu_before, wall_before = cpu.seconds(), time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        sampler.start()
        tasks: list[asyncio.Task[None]] = []
        kinds = itertools.cycle(["embed"] + ["infer"] * 9)
        start = time.monotonic()
        for n in range(int(rate * seconds)):
            delay = start + n / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_one(session, url, key, next(kinds), run)))
        await asyncio.gather(*tasks)
        stop.set()
        sampler.join()
    run.gateway_cores = (cpu.seconds() - cpu_before) / (time.monotonic() - wall_before)
    return run


def _q(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _report(run: Run, max_inflight: str) -> None:
    by_status: dict[int, int] = {}
    for a in run.answers:
        by_status[a.status] = by_status.get(a.status, 0) + 1
    statuses = dict(sorted(by_status.items()))
    print(f"\n## {run.rate:g} req/s offered, MAX_INFLIGHT_REQUESTS {max_inflight}: answers {statuses}")
    print("| samples | outstanding | accept queue | accepted, not in the edge | in the edge | probe ms | loop lag ms |")
    print("|---|---|---|---|---|---|---|")
    s = run.samples
    rows = {
        "outstanding": [float(x.outstanding) for x in s],
        "queue": [float(x.accept_queue) for x in s],
        "before": [max(0.0, x.outstanding - x.accept_queue - x.in_edge) for x in s if x.in_edge == x.in_edge],
        "edge": [x.in_edge for x in s if x.in_edge == x.in_edge],
        "probe": [x.probe_ms for x in s],
        "lag": [x.lag_ms for x in s if x.lag_ms == x.lag_ms],
    }
    for label, q in (("p50", 0.5), ("p90", 0.9), ("max", 1.0)):
        cells = " | ".join(f"{_q(v, q):.0f}" for v in rows.values())
        print(f"| {label} | {cells} |")
    served = [a for a in run.answers if a.kind == "infer" and a.created and a.finished]
    if served:
        before = [(a.created - a.sent) * 1e3 for a in served if a.created]
        running = [(a.finished - a.created) * 1e3 for a in served if a.finished and a.created]
        after = [(a.answered - a.finished) * 1e3 for a in served if a.finished]
        print("\n| POST /infer answered 200, ms | p50 | p90 | max |\n|---|---|---|---|")
        parts = (("send -> created", before), ("created -> finished", running), ("finished -> answer", after))
        for label, values in parts:
            print(f"| {label} | {_q(values, 0.5):.1f} | {_q(values, 0.9):.1f} | {_q(values, 1.0):.1f} |")
    refused = [(a.answered - a.sent) * 1e3 for a in run.answers if a.status in (429, 503)]
    if refused:
        print(f"\nrefusals ({len(refused)}): answered in p50 {_q(refused, 0.5):.1f} / p90 {_q(refused, 0.9):.1f} ms")
    embeds = [(a.answered - a.sent) * 1e3 for a in run.answers if a.kind == "embed" and a.status == 200]
    if embeds:
        print(f"/v1/embeddings of 16 answered 200: p50 {_q(embeds, 0.5):.1f} / p90 {_q(embeds, 0.9):.1f} ms")
    print(
        f"answers per second over the run: {len(run.answers) / max(1e-9, _span(run)):.1f}; "
        f"the gateway's CPU {run.gateway_cores:.2f} cores"
    )


def _span(run: Run) -> float:
    if not run.answers:
        return 0.0
    return max(a.answered for a in run.answers) - min(a.sent for a in run.answers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="10,25,50", help="offered requests a second, comma separated")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long each rate is offered")
    parser.add_argument("--max-inflight", default="", help="the gateway's MAX_INFLIGHT_REQUESTS")
    args = parser.parse_args()
    env = {"MAX_INFLIGHT_REQUESTS": args.max_inflight} if args.max_inflight else {}
    with local_stack(**env) as stack:
        for rate in (float(r) for r in args.rates.split(",")):
            run = asyncio.run(_offer(stack.gateway, stack.api_key, rate, args.seconds))
            _report(run, args.max_inflight or "default")
            time.sleep(2)  # the last answers' stores settle before the next rate


if __name__ == "__main__":
    main()
