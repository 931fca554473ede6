"""Profile the gateway under load: runs the open-loop benchmark at one rate, records the
gateway process with py-spy during the `sync` slice, and prints where its CPU goes, by
package (each sample counted once, for the innermost frame of a known package). With
--relay STREAMS it runs the relay section instead (that many concurrent token streams of
`llm_synthetic`) and records the gateway while it relays (py-spy samples only busy
threads, so the direct phase, when the gateway idles, adds little). With --ttft ROUNDS it
runs the TTFT section at 32 concurrent starts for that many rounds (each a burst of 32 SSE
streams and one of 32 `/v1` streams, besides direct's) and records the gateway throughout:
with --functions, µs a stream start (its whole one-token stream: start, token, finish).

With --functions N it also prints the N functions of the gateway's own code (and the
library calls it makes) with the most samples beneath them (inclusive), in µs of CPU per
request of the recorded slice (rate × seconds requests); --summarize reads a raw file
recorded before instead of running.

Run:  .venv/bin/python -m bench.profile_gateway --rate 200 --seconds 12
      .venv/bin/python -m bench.profile_gateway --many 64 --seconds 20 --functions 40
      .venv/bin/python -m bench.profile_gateway --relay 200 --seconds 40
      .venv/bin/python -m bench.profile_gateway --ttft 10 --functions 40
      .venv/bin/python -m bench.profile_gateway --rate 250 --seconds 12 --summarize /tmp/raw.txt --functions 40
Needs py-spy (`.venv/bin/pip install py-spy`); raw stacks are kept in --raw.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = [
    "gateway/server/api", "gateway/server/tenants", "gateway/server/queue", "gateway/server/dispatch",
    "gateway/server/results", "gateway/server/replicas", "gateway/server/models", "gateway/server/routing",
    "gateway/server/metrics", "gateway/server/openai", "gateway/common", "starlette", "fastapi", "uvicorn",
    "pydantic", "redis", "tritonclient", "grpc", "prometheus_client", "limits", "pymongo", "structlog",
    "logging", "json", "httptools", "asyncio", "tenacity", "sse_starlette", "contextlib", "threading",
]  # fmt: skip
WARM_UP_S = 6.0  # the benchmark warms every path for 2 s first
SAMPLE_RATE = 200  # py-spy samples a second
TTFT_BURST = 32  # concurrent stream starts a round of --ttft
# The process's entry (function, file), not a request's work.
ENTRY = {("<module>", "gateway/cli.py"), ("main", "gateway/cli.py"), ("serve", "gateway/cli.py")}
ENTRY.add(("serve", "gateway/server/serve.py"))


def summarize(raw: Path) -> str:
    total = 0
    by_package: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        for frame in reversed(stack.split(";")):
            found = re.search(r"\((.*?):\d+\)", frame)
            package = next((p for p in PACKAGES if found and p in found.group(1)), None)
            if package:
                by_package[package] += samples
                break
        else:
            by_package["(other)"] += samples
    lines = [f"{total} samples", "", "| package | share |", "| --- | --- |"]
    lines += [f"| {name} | {count / total:.1%} |" for name, count in by_package.most_common()]
    return "\n".join(lines)


def inclusive(raw: Path, requests: float, top: int, rate: int = SAMPLE_RATE) -> str:
    """The gateway's functions (and the first library function each calls) by the samples
    beneath them, each sample counted once per function, in µs per request; and each one's
    own: the samples where it is the innermost function of ours."""
    counts: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        names = []
        innermost = ""  # the innermost of ours: its "own" time (with the library calls under it)
        caller_is_ours = False
        for frame in stack.split(";"):
            found = re.match(r"\s*(\S+) \((.*?):\d+\)", frame)
            if not found:
                continue
            function, path = found.group(1), found.group(2)
            ours = "gateway/" in path and (function, "gateway/" + path.rpartition("gateway/")[2]) not in ENTRY
            if ours:
                names.append(innermost := f"{function} ({path.rpartition('gateway/')[2]})")
            elif caller_is_ours:
                names.append(f"{function} ({path.rpartition('/')[2]}, from the gateway)")
            caller_is_ours = ours
        for name in set(names):
            counts[name] += int(count)
        if innermost:
            own[innermost] += int(count)
    per_sample_us = 1e6 / rate / requests
    lines = ["| function | inclusive µs/request | own µs/request |", "| --- | --- | --- |"]
    lines += [
        f"| {name} | {n * per_sample_us:.0f} | {own[name] * per_sample_us:.0f} |" for name, n in counts.most_common(top)
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=12, help="how long to record (the slice is 2 s longer)")
    parser.add_argument("--relay", type=int, default=0, help="profile the relay of this many streams instead")
    parser.add_argument("--many", type=int, default=0, help="profile clip_text embeddings calls of this many inputs")
    parser.add_argument("--ttft", type=int, default=0, help="profile this many rounds of 32 concurrent stream starts")
    parser.add_argument("--raw", type=Path, default=Path("/tmp/gateway-profile.txt"))
    parser.add_argument("--functions", type=int, default=0, help="also the top N functions, per request")
    parser.add_argument("--summarize", type=Path, help="a raw file recorded before: only summarize it")
    parser.add_argument("--sample-rate", type=int, default=SAMPLE_RATE, help="py-spy samples a second")
    parser.add_argument("--native", action="store_true", help="record C frames too (py-spy pauses the process)")
    args = parser.parse_args()
    if args.summarize:
        print(summarize(args.summarize))
        if args.functions:
            print("\n" + inclusive(args.summarize, args.rate * args.seconds, args.functions))
        return
    slice_s = args.seconds + 2
    log = Path("/tmp/gateway-profile-bench.log")
    command = [sys.executable, "-m", "bench.gateway_bench", "--sections", "open", "--rates", f"{args.rate:g}"]
    command += ["--slice", f"{slice_s:g}", "--rounds", "1"]
    if args.relay:
        command = [sys.executable, "-m", "bench.gateway_bench", "--sections", "relay", "--streams", str(args.relay)]
    if args.many:
        command = [sys.executable, "-m", "bench.gateway_bench", "--sections", "many", "--many-model", "clip_text"]
        command += ["--many-inputs", str(args.many), "--slice", f"{slice_s:g}", "--rounds", "1"]
    if args.ttft:
        command = [sys.executable, "-m", "bench.gateway_bench", "--model", "llm_synthetic", "--sections", "ttft"]
        command += ["--ttft-streams", str(TTFT_BURST), "--ttft-samples", str(TTFT_BURST * args.ttft)]
        args.seconds = max(args.seconds, 600)  # until the bench ends (py-spy stops with the gateway)
    whole = bool(args.relay or args.many or args.ttft)  # recorded from the start: the gateway idles in the direct phase
    with log.open("w") as err:
        bench = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
        try:
            pid = None
            deadline = time.monotonic() + 300
            while pid is None:
                if time.monotonic() > deadline or bench.poll() is not None:
                    sys.exit(f"the stack did not start; see {log}")
                found = re.search(r"gateway +ready.*?pid (\d+)", log.read_text())
                pid = int(found.group(1)) if found else None
                time.sleep(0.5)
            if not whole:
                time.sleep(WARM_UP_S + slice_s + 1)  # past the warm-up and the direct slice
            spy = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(pid)]
            spy += ["--native"] if args.native else ["--nonblocking"]
            spy += ["-d", f"{args.seconds:g}", "-r", str(args.sample_rate), "-f", "raw", "-o", str(args.raw)]
            subprocess.run(spy, check=not whole, capture_output=True)  # the relay may end first
        finally:
            bench.wait()
    print(summarize(args.raw))
    if args.functions and args.many:
        print(f"\n(per {args.many}-input call: divide by the calls the bench made in the slice)")
        print(inclusive(args.raw, 1, args.functions, args.sample_rate))
    elif args.functions and args.ttft:
        starts = 2 * TTFT_BURST * args.ttft
        print(f"\n(per stream start: {starts} starts, SSE and /v1 alike)")
        print(inclusive(args.raw, starts, args.functions, args.sample_rate))
    elif args.functions and not args.relay:
        print("\n" + inclusive(args.raw, args.rate * args.seconds, args.functions, args.sample_rate))


if __name__ == "__main__":
    main()
