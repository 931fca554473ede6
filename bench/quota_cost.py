"""What a tenant's rate limits cost an admission (issue 30): `Quotas.admit` for a tenant
with both limits (requests and tokens per minute, set high: every admission is counted,
none refused), N admissions at once, on a Redis of its own (the stack's settings), two
ways side by side in alternating rows:

- grouped: the `limits` library's scripts through the gateway's group commit, as the
  gateway runs on one Redis (a hit and the read of its window in one pipeline; the
  admissions of a loop turn together);
- alone: the library's own storage and connections, a round trip a call (as the gateway
  did before, and still does on a Redis Cluster).

Each row: the CPU of this process an admission (the gateway's side: `limits`, the group
commit, redis-py; on uvloop, the gateway's loop), Redis's CPU an admission (INFO cpu), its
commands an admission (INFO commandstats, which counts those inside the scripts), the
median time of one admission, and admissions a second.

Run:  .venv/bin/python -m bench.quota_cost
      .venv/bin/python -m bench.quota_cost --together 1,4,16,32 --admissions 4000 --rounds 2
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import uvloop

from bench.redis_info import RedisSample, RedisWindow
from bench.stack import lone_redis
from gateway.common.redis import GroupCommit, connect
from gateway.server.tenants.config import TenantConfig, TenantLimits
from gateway.server.tenants.quotas import Quotas

LIMITS = TenantLimits(requests_per_minute=10**9, tokens_per_minute=10**9)
PROMPT_TOKENS = 12


async def admitted(quotas: Quotas, config: TenantConfig, took: list[float]) -> None:
    began = time.perf_counter()
    await quotas.admit(config, PROMPT_TOKENS)
    took.append(time.perf_counter() - began)


async def measure(url: str, way: str, together: int, admissions: int, tenants: int) -> str:
    client = connect(url, timeout_s=5.0, max_connections=64)
    quotas = Quotas(url, group=GroupCommit(client)) if way == "grouped" else Quotas(url, timeout_s=5.0)
    configs = [TenantConfig(tenant=f"quota-{way}-{n}", limits=LIMITS) for n in range(tenants)]
    took: list[float] = []
    try:
        for _ in range(max(2, 64 // together)):  # scripts loaded, connections made
            await asyncio.gather(*(admitted(quotas, configs[n % tenants], []) for n in range(together)))
        before = RedisSample.at(url)
        rounds = max(1, admissions // together)
        began, own_began = time.perf_counter(), time.process_time()
        for _ in range(rounds):
            await asyncio.gather(*(admitted(quotas, configs[n % tenants], took) for n in range(together)))
        wall, own = time.perf_counter() - began, time.process_time() - own_began
        redis = RedisWindow.between(before, RedisSample.at(url))
    finally:
        await client.aclose()
    done = rounds * together
    commands = redis.commands - redis.calls["evalsha"]  # those the scripts ran
    return (
        f"| {together} | {way} | {own * 1e6 / done:.0f} | {redis.cpu_s * 1e6 / done:.0f} | {commands / done:.1f} "
        f"| {statistics.median(took) * 1e3:.2f} | {done / wall:,.0f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--together", default="1,4,16,32", help="admissions at once")
    parser.add_argument("--admissions", type=int, default=3000, help="admissions measured per row")
    parser.add_argument("--tenants", type=int, default=16, help="tenants the admissions are spread over")
    parser.add_argument("--rounds", type=int, default=2, help="rows of each way per group size, alternating")
    args = parser.parse_args()
    lines = [
        f"Quotas.admit of a tenant with both rate limits, on a Redis of its own, {args.admissions} admissions "
        f"per row, {args.tenants} tenants:",
        "",
        "| admissions together | way | client CPU µs an admission | Redis CPU µs an admission "
        "| commands inside an admission | median ms an admission | admissions/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    with lone_redis() as url:
        for together in (int(g) for g in args.together.split(",")):
            for _ in range(args.rounds):
                for way in ("grouped", "alone"):
                    lines.append(uvloop.run(measure(url, way, together, args.admissions, args.tenants)))
                    print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
