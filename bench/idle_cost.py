"""What an idle gateway costs: starts the local stack, lets it settle with no request,
and reads the CPU (utime + stime, bench/cpu.py) of the gateway process over a window, in
ms of CPU per second per gateway process, with each of its threads, and what Redis and
Triton spend meanwhile (an idle gateway's polls, sweeps and scrapes are work for them
too). N gateway processes pay it N times.

With --profile, py-spy then records the gateway over a second window of the same length
and prints which loop the samples belong to: the outermost frame of the gateway's own
code in each sample (the task or thread that runs), else the innermost known package.

Run:  .venv/bin/python -m bench.idle_cost --seconds 30
      .venv/bin/python -m bench.idle_cost --seconds 30 --profile
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import redis

from bench.cpu import ProcessCpu, listening_pids
from bench.profile_gateway import PACKAGES
from bench.stack import local_stack
from gateway.server.queue import scripts

SETTLE_S = 5.0  # the start-up's own work (first probes, scripts loaded, warm-up) done


def thread_seconds(pid: int) -> dict[str, float]:
    """utime + stime per thread name (threads of one name added up)."""
    found: dict[str, float] = collections.defaultdict(float)
    process = psutil.Process(pid)
    for thread in process.threads():
        try:
            name = Path(f"/proc/{pid}/task/{thread.id}/comm").read_text().strip()
        except OSError:
            continue
        found[name] += thread.user_time + thread.system_time
    return found


# The process's entry and the supervisor of every loop: not the loop itself.
ENTRY = ("gateway/cli.py", "gateway/server/serve.py", "gateway/common/retry.py")


def loop_of(stack: str) -> str:
    """The loop a sample belongs to: its outermost frame in the gateway's code past the
    entry (the coroutine a task runs, or a thread's target), else the innermost known
    package and function."""
    frames = stack.split(";")
    for frame in frames:
        found = re.match(r"\s*(\S+) \((.*?gateway/.*?\.py):\d+\)", frame)
        if found and not found.group(2).endswith(ENTRY):
            return f"{found.group(1)} ({found.group(2).rpartition('gateway/')[2]})"
    for frame in reversed(frames):
        found = re.search(r"\((.*?):\d+\)", frame)
        package = next((p for p in PACKAGES if found and p in found.group(1)), None)
        if package:
            return f"{package}: {frame.split()[0]}"
    return "(other)"


def summarize(raw: Path, seconds: float, rate: int) -> str:
    by_loop: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            by_loop[loop_of(stack)] += int(count)
            total += int(count)
    # A sample stands for 1/rate s of a thread on CPU (py-spy skips idle threads).
    lines = [f"{total} samples at {rate}/s ({total / rate / seconds * 1000:.1f} ms a second on CPU)", ""]
    lines += ["| loop | ms/s | share |", "| --- | --- | --- |"]
    for name, samples in by_loop.most_common():
        lines.append(f"| {name} | {samples / rate / seconds * 1000:.2f} | {samples / total:.1%} |")
    return "\n".join(lines)


def redis_commands(url: str, seconds: float, into: collections.Counter[str]) -> None:
    """Count the commands clients send to Redis for `seconds` (MONITOR; a script by its
    name in scripts.py; the commands scripts run are left out)."""
    names = {
        hashlib.sha1(text.encode()).hexdigest(): name
        for name, text in vars(scripts).items()
        if name.isupper() and isinstance(text, str)
    }
    client = redis.Redis.from_url(url, socket_timeout=0.5)
    deadline = time.monotonic() + seconds
    with client.monitor() as monitor:
        while time.monotonic() < deadline:
            try:
                command = monitor.next_command()
            except redis.TimeoutError:
                continue
            if command.get("client_type") == "lua":
                continue
            words = command["command"].split()
            name = words[0].upper()
            if name == "EVALSHA" and len(words) > 1:
                name = f"EVALSHA {names.get(words[1], words[1][:8])}"
            into[name] += 1
    client.close()


def per_second(before: float, after: float, seconds: float) -> str:
    return f"{(after - before) / seconds * 1000:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--workers", type=int, default=1, help="gateway worker processes")
    parser.add_argument("--profile", action="store_true", help="then record the gateway with py-spy")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples a second")
    parser.add_argument("--raw", type=Path, default=Path("/tmp/gateway-idle-profile.txt"))
    args = parser.parse_args()
    with local_stack(gateway_workers=args.workers) as stack:
        assert stack.stack is not None
        settings = stack.stack.settings
        gateway = ProcessCpu.of_urls([stack.gateway])
        others = {
            "redis": ProcessCpu(listening_pids({settings.redis_port})),
            "triton": ProcessCpu(listening_pids({settings.triton_http_port})),
        }
        pids = listening_pids({urlsplit(stack.gateway).port or 80})
        time.sleep(SETTLE_S)
        processes = [p for root in gateway.roots for p in [root, *root.children(recursive=True)]]
        workers = [p for p in processes if not p.children()] or processes  # the ones that serve
        threads_before = {p.pid: thread_seconds(p.pid) for p in workers}
        before = {"gateway": gateway.seconds()} | {name: cpu.seconds() for name, cpu in others.items()}
        started = time.monotonic()
        time.sleep(args.seconds)
        elapsed = time.monotonic() - started
        after = {"gateway": gateway.seconds()} | {name: cpu.seconds() for name, cpu in others.items()}
        threads_after = {p.pid: thread_seconds(p.pid) for p in workers}
        print(f"idle for {elapsed:.1f} s, {len(workers)} gateway process(es) serving (pids {sorted(pids)})\n")
        print("| process | CPU ms/s |\n| --- | --- |")
        each = (after["gateway"] - before["gateway"]) / len(workers)
        print(f"| gateway, per process | {each / elapsed * 1000:.2f} |")
        for name in others:
            print(f"| {name} | {per_second(before[name], after[name], elapsed)} |")
        print("\n| gateway thread | CPU ms/s |\n| --- | --- |")
        threads: dict[str, float] = collections.defaultdict(float)
        for pid, names in threads_after.items():
            for name, seconds in names.items():
                threads[name] += seconds - threads_before[pid].get(name, 0.0)
        for name, seconds in sorted(threads.items(), key=lambda item: -item[1]):
            print(f"| {name} | {seconds / len(workers) / elapsed * 1000:.2f} |")
        if args.profile:
            commands: collections.Counter[str] = collections.Counter()
            monitor = threading.Thread(target=redis_commands, args=(stack.redis, args.seconds, commands))
            monitor.start()
            spy = [str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(workers[0].pid), "--nonblocking"]
            spy += ["-d", f"{args.seconds:g}", "-r", str(args.rate), "-f", "raw", "-o", str(args.raw)]
            subprocess.run(spy, check=True, capture_output=True)
            monitor.join()
            print("\n" + summarize(args.raw, args.seconds, args.rate))
            print("\n| Redis command (all clients) | a second |\n| --- | --- |")
            for name, count in commands.most_common():
                print(f"| {name} | {count / args.seconds:.2f} |")


if __name__ == "__main__":
    main()
