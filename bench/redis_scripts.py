"""What the queue cycle costs Redis by itself (issue 30): the gateway's SUBMIT (started at
once) and FINISH of a `clip_text`-sized request, through the process's own group commit,
on a Redis of their own (the stack's settings: append-only file, everysec) with nothing
else on the machine working. N requests go through the cycle together, so each script
call carries N of them (as the group commit merges the calls of concurrent requests):
Redis's CPU a request (INFO cpu), its commands a request (INFO commandstats, which counts
the commands run inside the scripts), and the microseconds EVALSHA took a request, split
into the commands the scripts ran and the rest (Lua, argument passing, replies); and the
CPU this process spent a request on its side of the cycle (JobStore, the group commit,
redis-py), with the gateway's own client (gateway.common.redis.connect) and event loop
(uvloop).

The closed loop of bench.gateway_bench measures the same scripts with the binder's own
calls added and Redis sharing the machine's cores with everything else; this says what
the scripts themselves cost, and how that falls with the size of a group.

Run:  .venv/bin/python -m bench.redis_scripts
      .venv/bin/python -m bench.redis_scripts --groups 1,4,16,32 --requests 4000 --tenants 16
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from bench.stack import lone_redis
from gateway.common.redis import GroupCommit, RedisClients, connect
from gateway.protocol import State, new_request_id
from gateway.server.queue.jobs import Admission, Job, JobStore, NewRequest

OPEN = Admission(max_backlog=100_000, max_batch_backlog=100_000, max_bytes=10**10, reserve=4)
TEXT = "a photo of a cat sitting on a mat"
# What accept() stores for a clip_text request (spine.accept's payload).
PAYLOAD = {
    "inputs": {"text": TEXT},
    "parameters": {},
    "stream": False,
    "webhook": None,
    "inputs_stored": {"text": TEXT},
    "priority": "normal",
    "metadata": {},
    "prompt_tokens": 9,
    "trace_id": "0123456789abcdef0123456789abcdef",
}
IGNORED = {"info", "config|resetstat", "config"}


async def cycle(store: JobStore, tenant: str) -> None:
    """One request: SUBMIT (started at once in this process), then FINISH."""
    now = time.time()
    new = NewRequest(new_request_id(now), PAYLOAD, now, now + 60)
    submitted = await store.submit(
        [new],
        model="clip_text",
        tenant=tenant,
        band="normal",
        admission=OPEN,
        start_as="bench",
    )
    if submitted.outcome != "started":
        raise RuntimeError(f"SUBMIT answered {submitted.outcome}, not started")
    job = Job.started_at_once(new, model="clip_text", tenant=tenant, band="normal", run=submitted.run)
    await store.finish(job.record(State.SUCCEEDED), run=job.run)


async def measure(url: str, group: int, requests: int, tenants: int) -> str:
    client = connect(url, timeout_s=5.0, max_connections=64)
    clients = RedisClients(main=client, group=GroupCommit(client))
    store = JobStore(client, idempotency_ttl_s=60, lease_ms=60_000, replication=clients)
    try:
        rounds = max(1, requests // group)
        for _ in range(max(2, 64 // group)):  # scripts loaded, tenants' settings written
            await asyncio.gather(*(cycle(store, f"t{n % tenants}") for n in range(group)))
        await client.config_resetstat()
        cpu = await client.info("cpu")
        began, own_began = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(cycle(store, f"t{n % tenants}") for n in range(group)))
        wall, own = time.perf_counter() - began, time.process_time() - own_began
        after, stats = await client.info("cpu"), await client.info("commandstats")
    finally:
        await client.aclose()
    done = rounds * group
    used = after["used_cpu_sys"] + after["used_cpu_user"] - cpu["used_cpu_sys"] - cpu["used_cpu_user"]
    calls = {name.removeprefix("cmdstat_"): stat for name, stat in stats.items() if name.startswith("cmdstat_")}
    own_calls = {name: stat for name, stat in calls.items() if name not in IGNORED}
    evalsha = own_calls.get("evalsha", {"calls": 0, "usec": 0})
    inner = sum(stat["usec"] for name, stat in own_calls.items() if name != "evalsha")
    commands = sum(stat["calls"] for name, stat in own_calls.items() if name != "evalsha")
    return (
        f"| {group} | {evalsha['calls'] / done:.2f} | {commands / done:.1f} | {used * 1e6 / done:.0f} "
        f"| {evalsha['usec'] / done:.0f} | {inner / done:.0f} | {(evalsha['usec'] - inner) / done:.0f} "
        f"| {own * 1e6 / done:.0f} | {done / wall:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", default="1,4,16,32", help="requests in the cycle together")
    parser.add_argument("--requests", type=int, default=3000, help="requests measured per group size")
    parser.add_argument("--tenants", type=int, default=1, help="tenants the requests of a group are spread over")
    args = parser.parse_args()
    lines = [
        "SUBMIT (started at once) + FINISH of a clip_text request, on a Redis of their own, "
        f"{args.requests} requests per row, {args.tenants} tenant(s):",
        "",
        "| requests together | script calls a request | commands inside a request | Redis CPU µs a request "
        "| EVALSHA µs a request | of which its commands | of which the rest | client CPU µs a request | requests/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with lone_redis() as url:
        for group in (int(g) for g in args.groups.split(",")):
            lines.append(uvloop.run(measure(url, group, args.requests, args.tenants)))  # the gateway's loop
    print("\n".join(lines))


if __name__ == "__main__":
    main()
