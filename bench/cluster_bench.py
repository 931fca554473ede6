"""The queue core on one Redis and on a Redis Cluster, with and without WAIT, side by side
in one run: what a request costs Redis, and how many a Redis core can carry.

    .venv/bin/python -m bench.cluster_bench                      # the figures in docs/benchmarks.md
    .venv/bin/python -m bench.cluster_bench --cycles 4000 --processes 2 --concurrency 32 --json out.json

It starts (by pid, on free loopback ports, stopped at the end) one Redis with one replica,
and a cluster of 3 primaries and 3 replicas (REDIS_SHARDS=64, so the tenants' shards
spread evenly over the primaries), all with the append-only file on (everysec), as the
deployment runs them. Worker processes drive the real JobStore (the Lua scripts the
gateway runs, through gateway.common.redis) with no gateway, Triton or binder in the way:

- `embedding`: SUBMIT, TAKE, FINISH with a 384-float embedding record (what a text_embed
  request costs Redis, the results stream entry the binder reads included);
- `generation`: the same with a 500-token text record (a non-streamed generation);
- `emit`: EMIT of one token event (a streamed generation adds one per token window).

Each row: cycles (or emits) per second over the run, the p50/p99 latency of SUBMIT (of
EMIT in the emit rows; `one-by-one`: embedding cycles one at a time, the latency WAIT
adds with nothing queued), and per cycle: CPU of the Redis primaries and of the replicas
(utime + stime of their processes, the figure that sizes a deployment: throughput here is
bound by the client processes on a small machine), commands, bytes in and out of the
primaries (replication included), the primaries' time executing commands and scripts
(INFO commandstats; the rest of their CPU is network, AOF and replication), and memory
held afterwards (the live state kept for LIVE_STATE_TTL_S and the results entry, until
the binders trim it)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import redis

from bench.redis_info import RedisSample, RedisWindow
from gateway.stack.process import ManagedProcess, free_port, port_is_free, stop_processes, wait_until
from gateway.stack.services import form_redis_cluster, redis_cluster_node_spec, redis_spec

PHASES = ("embedding", "generation", "emit")
# Full-precision floats, as a real 384-d embedding's JSON carries them (about 8.6 KB).
EMBEDDING = [math.sin(i * 7.919) * 0.05 for i in range(384)]
TEXT_500_TOKENS = " ".join(["word"] * 500)  # about 2,500 characters
PROMPT = {"inputs": {"text": "a sentence of about a hundred characters to embed, as a typical request would carry it"}}


@dataclass
class Deployment:
    name: str
    url: str
    cluster_nodes: list[str]
    shards: int
    primaries: list[int]  # pids
    replicas: list[int]
    primary_ports: list[int]


@dataclass
class Row:
    deployment: str
    wait: int
    phase: str
    count: int
    per_s: float
    p50_ms: float
    p99_ms: float
    primary_cpu_us: float
    exec_us: float  # of it, executing commands and scripts (INFO commandstats)
    replica_cpu_us: float
    client_cpu_us: float
    commands: float
    bytes_in: float
    bytes_out: float
    memory_bytes: float
    primary_share: list[float] = field(default_factory=list)  # of the commands, per primary


# -- the servers ---------------------------------------------------------------------------


def _ports(count: int, bus: bool) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports and (not bus or (port + 10000 < 65536 and port_is_free(port + 10000))):
            ports.append(port)
    return ports


def start_single(data: Path, started: list[ManagedProcess]) -> Deployment:
    """One Redis with one replica (so WAIT 1 can be met), AOF on as in production."""
    primary_port, replica_port = _ports(2, bus=False)
    primary = ManagedProcess(redis_spec(data_dir=data, host="127.0.0.1", port=primary_port, name="bench-primary"))
    spec = redis_spec(data_dir=data, host="127.0.0.1", port=replica_port, name="bench-replica")
    spec.argv += ["--replicaof", "127.0.0.1", str(primary_port)]
    replica = ManagedProcess(spec)
    for process in (primary, replica):
        process.start()
        started.append(process)
        process.wait_ready(time.monotonic() + 60)
    client = redis.Redis(port=replica_port, decode_responses=True)
    if not wait_until(lambda: client.info("replication").get("master_link_status") == "up", 60):
        raise RuntimeError("the replica did not connect")
    client.close()
    return Deployment(
        "one Redis",
        f"redis://127.0.0.1:{primary_port}/0",
        [],
        1,
        [primary.pid or 0],
        [replica.pid or 0],
        [primary_port],
    )


def start_cluster(data: Path, started: list[ManagedProcess], shards: int) -> Deployment:
    ports = _ports(6, bus=True)
    nodes = [
        ManagedProcess(redis_cluster_node_spec(data_dir=data, host="127.0.0.1", port=port, name=f"bench-node-{port}"))
        for port in ports
    ]
    for process in nodes:
        process.start()
        started.append(process)
    for process in nodes:
        process.wait_ready(time.monotonic() + 60)
    form_redis_cluster([("127.0.0.1", port) for port in ports], replicas=1)
    return Deployment(
        "cluster 3+3",
        "",
        [f"127.0.0.1:{port}" for port in ports],
        shards,
        [p.pid or 0 for p in nodes[:3]],
        [p.pid or 0 for p in nodes[3:]],
        ports[:3],
    )


def _cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _stats(ports: list[int]) -> list[RedisSample]:
    return [RedisSample.at(f"redis://127.0.0.1:{port}") for port in ports]


def _flush(ports: list[int]) -> None:
    for port in ports:
        client = redis.Redis(port=port, decode_responses=True)
        try:
            client.flushall()
        finally:
            client.close()


# -- the clients ----------------------------------------------------------------------------


def _worker(
    deployment: dict[str, Any], phase: str, count: int, concurrency: int, wait: int, seed: int, barrier: Any, out: Any
) -> None:
    out.put(asyncio.run(_drive(deployment, phase, count, concurrency, wait, seed, barrier)))


async def _drive(
    deployment: dict[str, Any], phase: str, count: int, concurrency: int, wait: int, seed: int, barrier: Any
) -> dict[str, Any]:
    from gateway.common.redis import RedisClients
    from gateway.protocol import State, new_request_id
    from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest

    clients = RedisClients.open(
        url=deployment["url"],
        cluster_nodes=deployment["cluster_nodes"],
        timeout_s=10,
        max_connections=max(16, concurrency * 2),
        wait_replicas=wait,
        wait_timeout_ms=1000,
    )
    jobs = JobStore(clients.main, shards=deployment["shards"], idempotency_ttl_s=3600, replication=clients)
    admission = Admission(max_backlog=10**9, max_batch_backlog=10**9, max_bytes=10**12)
    tenants = [f"bench-{seed}-{i}" for i in range(3 * deployment["shards"])]
    model = f"bench-{phase}"
    consumer = f"bench-worker-{seed}"
    latencies: list[float] = []
    left = [count]

    async def cycle(tenant: str, timed: bool) -> Job:
        shard = jobs.shard_for(tenant)
        now = time.time()
        new = NewRequest(new_request_id(now, shard.index), PROMPT, now, now + 300)
        started = time.perf_counter()
        await jobs.submit([new], model=model, tenant=tenant, band="normal", admission=admission)
        if timed:
            latencies.append(time.perf_counter() - started)
        job = await jobs.take(shard, model, consumer)
        assert isinstance(job, Job), job
        return job

    async def finish(job: Job) -> None:
        outputs = {"embedding": EMBEDDING} if phase == "embedding" else {"text_output": TEXT_500_TOKENS}
        assert await jobs.finish(job.record(State.SUCCEEDED, outputs=outputs), run=job.run) is not None

    async def lane(lane_index: int) -> None:
        tenant_index = lane_index
        while left[0] > 0:
            left[0] -= 1
            await finish(await cycle(tenants[tenant_index % len(tenants)], timed=True))
            tenant_index += concurrency

    async def emitting(job: Job) -> None:
        index = 0
        while left[0] > 0:
            left[0] -= 1
            started = time.perf_counter()
            await jobs.emit(job.request_id, job.run, index, " word", 1, [index % 50000])
            latencies.append(time.perf_counter() - started)
            index += 1

    # Before the clock starts, each lane runs one cycle (scripts loaded on every node,
    # connections open); for emits, each lane starts the request it will emit for.
    warm = [await cycle(tenants[i % len(tenants)], timed=False) for i in range(concurrency)]
    if phase != "emit":
        for job in warm:
            await finish(job)
    latencies.clear()
    await asyncio.to_thread(barrier.wait)
    cpu, wall = time.process_time(), time.perf_counter()
    if phase == "emit":
        await asyncio.gather(*(emitting(job) for job in warm))
    else:
        await asyncio.gather(*(lane(i) for i in range(concurrency)))
    result = {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall, "latencies": latencies}
    await clients.aclose()
    return result


def run_phase(
    deployment: Deployment, phase: str, wait: int, count: int, processes: int, concurrency: int, label: str = ""
) -> Row:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes + 1)
    out = context.Queue()
    share = {key: value for key, value in asdict(deployment).items() if key in ("url", "cluster_nodes", "shards")}
    workers = [
        context.Process(target=_worker, args=(share, phase, count // processes, concurrency, wait, seed, barrier, out))
        for seed in range(processes)
    ]
    for worker in workers:
        worker.start()
    barrier.wait()  # every worker warmed up
    before, cpu_p, cpu_r = _stats(deployment.primary_ports), _cpu(deployment.primaries), _cpu(deployment.replicas)
    results = [out.get(timeout=600) for _ in workers]
    cpu_p, cpu_r = _cpu(deployment.primaries) - cpu_p, _cpu(deployment.replicas) - cpu_r
    after = _stats(deployment.primary_ports)
    for worker in workers:
        worker.join()
    done = (count // processes) * processes
    wall = max(r["wall_s"] for r in results)
    latencies = sorted(x for r in results for x in r["latencies"])

    windows = [RedisWindow.between(b, a) for b, a in zip(before, after, strict=True)]
    total = sum(windows, RedisWindow())
    commands = [float(w.commands) for w in windows]
    memory = sum(float(a.info["used_memory"] - b.info["used_memory"]) for b, a in zip(before, after, strict=True))
    return Row(
        deployment=deployment.name,
        wait=wait,
        phase=label or phase,
        count=done,
        per_s=round(done / wall, 1),
        p50_ms=round(statistics.median(latencies) * 1000, 3) if latencies else 0.0,
        p99_ms=round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 3) if latencies else 0.0,
        primary_cpu_us=round(cpu_p / done * 1e6, 1),
        exec_us=round(total.exec_usec / done, 1),
        replica_cpu_us=round(cpu_r / done * 1e6, 1),
        client_cpu_us=round(sum(r["cpu_s"] for r in results) / done * 1e6, 1),
        commands=round(sum(commands) / done, 2),
        bytes_in=round(total.bytes_in / done),
        bytes_out=round(total.bytes_out / done),
        # Emits: the events stream's growth is below what the allocator's noise allows to see.
        memory_bytes=round(memory / done) if phase != "emit" else 0,
        primary_share=[round(c / max(1.0, sum(commands)), 2) for c in commands],
    )


def _print(rows: list[Row]) -> None:
    header = (
        f"{'deployment':<12} {'WAIT':>4} {'phase':<10} {'per s':>8} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'Redis µs':>9} {'exec µs':>8} {'repl µs':>8} {'client µs':>9} {'cmds':>5} {'in B':>6} {'out B':>7} "
        f"{'mem B':>6}  share"
    )
    print(header)
    for r in rows:
        print(
            f"{r.deployment:<12} {r.wait:>4} {r.phase:<10} {r.per_s:>8.0f} {r.p50_ms:>7.2f} {r.p99_ms:>7.2f} "
            f"{r.primary_cpu_us:>9.1f} {r.exec_us:>8.1f} {r.replica_cpu_us:>8.1f} {r.client_cpu_us:>9.1f} "
            f"{r.commands:>5.1f} {r.bytes_in:>6.0f} {r.bytes_out:>7.0f} {r.memory_bytes:>6.0f}  {r.primary_share}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=4000, help="requests per row (emits: 3x as many)")
    parser.add_argument("--processes", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight per client process")
    parser.add_argument("--shards", type=int, default=64, help="REDIS_SHARDS on the cluster")
    parser.add_argument("--latency-cycles", type=int, default=500, help="cycles one at a time (WAIT's latency)")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--json", type=Path, help="write the rows here as well")
    args = parser.parse_args()
    data = Path(tempfile.mkdtemp(prefix="cluster-bench-"))
    started: list[ManagedProcess] = []
    rows: list[Row] = []
    try:
        deployments = [start_single(data, started), start_cluster(data, started, args.shards)]
        print(
            f"{os.cpu_count()} cores; Redis {redis.Redis(port=deployments[0].primary_ports[0]).info()['redis_version']}"
        )
        for deployment in deployments:
            for wait in (0, 1):
                for phase in args.phases.split(","):
                    count = args.cycles * (3 if phase == "emit" else 1)
                    rows.append(run_phase(deployment, phase, wait, count, args.processes, args.concurrency))
                    _print(rows[-1:])
                    _flush(deployment.primary_ports)
                if args.latency_cycles:  # one request at a time: the latency WAIT adds
                    rows.append(run_phase(deployment, "embedding", wait, args.latency_cycles, 1, 1, "one-by-one"))
                    _print(rows[-1:])
                    _flush(deployment.primary_ports)
        print()
        _print(rows)
        if args.json:
            args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))
    finally:
        stop_processes(started)
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    main()
