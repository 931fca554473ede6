"""Scheduling benchmark: the cost of one scheduling decision as the number of waiting
tenants grows, on a real Redis.

A decision is the TAKE script (gateway.server.queue.scripts): pick the tenant with the
lowest virtual time in the highest band with work, pop its oldest request, start it. It
runs inside Redis over a sorted set of ready tenants, so it should cost the same at 100
and at 10,000 waiting tenants. Measured from the dispatcher's side (one round trip,
Python client included) and inside Redis (the script's own time, from
INFO commandstats), plus the dispatcher's own headroom bookkeeping (scheduler.Headroom)
for that many recent tenants.

For each tenant count: every tenant gets `--per-tenant` waiting requests of one model
(written straight into the queue's keys, as SUBMIT leaves them), then `--decisions`
TAKEs are timed one after another.

Run:  .venv/bin/python -m bench.scheduling_bench
      .venv/bin/python -m bench.scheduling_bench --tenants 100,1000,10000 --decisions 500
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import redis.asyncio as aioredis

from bench.stack import lone_redis
from gateway.protocol import new_request_id
from gateway.protocol.redis_keys import Shard
from gateway.server.dispatch.scheduler import Headroom
from gateway.server.queue.jobs import Job, JobStore

SHARD = Shard(0)
MODEL = "llm"


async def fill(client: aioredis.Redis, tenants: int, per_tenant: int) -> None:
    await client.flushdb()
    async with client.pipeline(transaction=False) as pipe:
        for n in range(tenants):
            tenant = f"tenant-{n}"
            for _ in range(per_tenant):
                request_id = new_request_id(shard=0)
                pipe.hset(
                    SHARD.request(request_id),
                    mapping={"state": "queued", "model": MODEL, "tenant": tenant, "band": "normal", "size": 100},
                )
                pipe.rpush(SHARD.queue(MODEL, "normal", tenant), request_id)
            pipe.zadd(SHARD.ready(MODEL, "normal"), {tenant: 0})
            pipe.hincrby(SHARD.backlog, "all", per_tenant)
            pipe.hincrby(SHARD.backlog, f"t:{tenant}", per_tenant)
            pipe.hincrby(SHARD.backlog, "bytes", 100 * per_tenant)
            pipe.hincrby(SHARD.backlog, f"m:{MODEL}", per_tenant)
            if n % 1000 == 999:
                await pipe.execute()
        await pipe.execute()


async def script_usec(client: aioredis.Redis) -> float:
    """Mean time per EVALSHA inside Redis since the last CONFIG RESETSTAT."""
    stats = await client.info("commandstats")
    evalsha = stats.get("cmdstat_evalsha", {})
    return float(evalsha.get("usec_per_call", 0.0))


async def measure(client: aioredis.Redis, tenants: int, per_tenant: int, decisions: int) -> dict[str, float]:
    await fill(client, tenants, per_tenant)
    store = JobStore(client, idempotency_ttl_s=60)
    await store.take(SHARD, MODEL, "warm-up")  # loads the script
    await client.config_resetstat()
    samples = []
    for _ in range(min(decisions, tenants * per_tenant - 1)):
        started = time.perf_counter()
        job = await store.take(SHARD, MODEL, "bench")
        samples.append((time.perf_counter() - started) * 1000)
        assert isinstance(job, Job)
    inside = await script_usec(client)
    headroom = Headroom()
    for n in range(tenants):
        headroom.touch(MODEL, f"tenant-{n}")
    started = time.perf_counter()
    for n in range(decisions):  # a decision: the tenant it started is touched, the reserve read
        headroom.touch(MODEL, f"tenant-{n % tenants}")
        headroom.reserve(MODEL, 32)
    bookkeeping_us = (time.perf_counter() - started) * 1e6 / decisions
    ordered = sorted(samples)
    return {
        "tenants": tenants,
        "decision_p50_ms": round(statistics.median(samples), 3),
        "decision_p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
        "in_redis_us": round(inside, 1),
        "headroom_us": round(bookkeeping_us, 2),
    }


async def run(args: argparse.Namespace, url: str) -> None:
    client = aioredis.from_url(url, decode_responses=True)
    try:
        print("| waiting tenants | decision p50 (ms) | decision p99 (ms) | TAKE inside Redis (µs) | headroom (µs) |")
        print("|---|---|---|---|---|")
        for tenants in [int(n) for n in args.tenants.split(",")]:
            row = await measure(client, tenants, args.per_tenant, args.decisions)
            print(
                f"| {row['tenants']:,} | {row['decision_p50_ms']} | {row['decision_p99_ms']} | "
                f"{row['in_redis_us']} | {row['headroom_us']} |"
            )
    finally:
        await client.aclose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", default="100,1000,10000")
    parser.add_argument("--per-tenant", type=int, default=2)
    parser.add_argument("--decisions", type=int, default=500)
    args = parser.parse_args()
    with lone_redis() as url:
        asyncio.run(run(args, url))


if __name__ == "__main__":
    main()
