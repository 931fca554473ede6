"""Where a Triton (re)start's time goes: the local stack's Triton started as `gateway up`
starts it (its model repository, weights and device), timed to ready, with each model's
own load read from Triton's log (from "loading" to "successfully loaded"). A restart after
a kill is the same start: Triton keeps nothing on disk.

Each round starts it with the twins (the *_nondecoupled models) at start and without them
(STACK_TRITON_TWINS, off by default: they load when asked for), alternating.

Run:  .venv/bin/python -m bench.triton_start
      .venv/bin/python -m bench.triton_start --rounds 3 --ways without,with
Triton is started here on free ports and stopped by its pid (with its stubs) when it ends."""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

from bench.stack import ROOT
from gateway.stack.process import ManagedProcess, free_port
from gateway.stack.settings import StackSettings
from gateway.stack.stack import LocalStack

# I1128 18:50:43.123456 1234 model_lifecycle.cc:472] "loading: llm_engine:1"
_LINE = re.compile(r"^[IWE](\d{4}) (\d\d:\d\d:\d\d\.\d+) .*?(loading|successfully loaded):? '?([\w.-]+)")


def model_times(log_text: str) -> dict[str, float]:
    """Seconds each model took to load, by Triton's own log lines."""
    began: dict[str, datetime] = {}
    took: dict[str, float] = {}
    for line in log_text.splitlines():
        found = _LINE.search(line)
        if not found:
            continue
        at = datetime.strptime(found.group(2), "%H:%M:%S.%f")
        name = found.group(4).split(":")[0].strip("'\"")
        if found.group(3) == "loading":
            began.setdefault(name, at)
        elif name in began:
            took[name] = (at - began[name]).total_seconds()
    return took


def start_once(stack: LocalStack, twins: bool, name: str) -> tuple[float, dict[str, float]]:
    stack.settings.triton_twins = twins
    spec = stack.triton(name, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    spec.log_file.unlink(missing_ok=True)
    process = ManagedProcess(spec)
    started = time.monotonic()
    process.start()
    try:
        process.wait_ready(started + 600)
        ready = time.monotonic() - started
    finally:
        process.stop()
    return ready, model_times(spec.log_file.read_text(errors="replace"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--ways", default="with,without", help="with and/or without the twins at start")
    parser.add_argument("--data-dir", type=Path, default=ROOT / ".stack-bench")
    args = parser.parse_args()
    stack = LocalStack(StackSettings(data_dir=args.data_dir, allow_downloads=False), log=lambda line: None)
    stack.data_dir.mkdir(parents=True, exist_ok=True)
    (stack.data_dir / "logs").mkdir(exist_ok=True)
    ready: dict[str, list[float]] = {}
    slowest: dict[str, dict[str, float]] = {}
    for round_ in range(args.rounds):
        for way in args.ways.split(","):
            seconds, models = start_once(stack, way == "with", f"triton-start-{way}")
            ready.setdefault(way, []).append(seconds)
            slowest[way] = dict(sorted(models.items(), key=lambda kv: -kv[1])[:6])
            print(
                f"round {round_ + 1} {way:<8} twins: ready in {seconds:6.1f} s, {len(models)} models", file=sys.stderr
            )
    print("| twins at start | ready s (median) | runs | slowest models (s) |")
    print("| --- | --- | --- | --- |")
    for way, values in ready.items():
        named = ", ".join(f"{name} {took:.1f}" for name, took in slowest[way].items())
        runs = " / ".join(f"{v:.1f}" for v in values)
        print(f"| {way} | {statistics.median(values):.1f} | {runs} | {named} |")


if __name__ == "__main__":
    main()
