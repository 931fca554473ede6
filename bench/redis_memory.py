"""Redis memory per request: what a finished request holds in Redis (MEMORY USAGE of its
hash and events stream, and the bytes of its results entry) right after it ends, and
again once the binder has stored it and RESULTS_KEEP_S has passed, for an embedding
(clip_text) and a streamed 100-token generation (llm_synthetic). Also Redis's own
used_memory before, at the end and after, divided by the requests.

Run:  .venv/bin/python -m bench.redis_memory [--requests 200] [--keep 5]
(starts its own local stack, with RESULTS_KEEP_S=--keep for its binder)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import httpx
import redis.asyncio as aioredis

from bench.stack import local_stack
from gateway.protocol.redis_keys import shard_of

KINDS: dict[str, dict[str, Any]] = {
    "clip_text embedding": {"model": "clip_text", "inputs": {"text": "a photo of a cat sitting on a mat"}},
    "llm_synthetic, 100 tokens streamed": {
        "model": "llm_synthetic",
        "inputs": {"text_input": "Hello world, the gateway", "max_tokens": 100},
        "stream": True,
    },
}


async def held(redis: aioredis.Redis, request_id: str) -> int:
    """Bytes Redis holds for the request: its own keys and its results entry's fields."""
    shard = shard_of(request_id)
    total = 0
    for key in (shard.request(request_id), shard.events(request_id), shard.tokens(request_id)):
        total += await redis.memory_usage(key, samples=0) or 0
    hash_fields = await redis.hmget(shard.request(request_id), "result")
    entry = hash_fields[0]
    if entry:
        for _, fields in await redis.xrange(shard.results, entry, entry):
            total += sum(len(k) + len(v) for k, v in fields.items())
    return total


async def finish(http: httpx.AsyncClient, body: dict) -> str:
    response = await http.post("/infer", json=body, headers={"Prefer": "wait=60"})
    record = response.json()
    assert response.status_code == 200 and record["status"] == "succeeded", response.text[:300]
    return record["request_id"]


async def measure(http: httpx.AsyncClient, redis: aioredis.Redis, body: dict, count: int, keep: float) -> list[str]:
    before = (await redis.info("memory"))["used_memory"]
    ids = []
    for _ in range(count // 20):
        ids += await asyncio.gather(*(finish(http, body) for _ in range(20)))
    at_end = [await held(redis, rid) for rid in ids]
    used_at_end = (await redis.info("memory"))["used_memory"]
    deadline = time.monotonic() + keep + 120
    while any([await held(redis, rid) for rid in ids[-5:]]) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
    await asyncio.sleep(6)  # one more trim round (binder.archive.TRIM_EVERY_S) for the rest
    after = [await held(redis, rid) for rid in ids]
    used_after = (await redis.info("memory"))["used_memory"]
    return [
        f"{statistics.median(at_end):.0f}",
        f"{(used_at_end - before) / len(ids):.0f}",
        f"{statistics.median(after):.0f}",
        f"{max(after)}",
        f"{(used_after - before) / len(ids):.0f}",
    ]


async def run(args: argparse.Namespace, gateway: str, redis_url: str, api_key: str) -> str:
    lines = [
        f"Redis bytes per finished request, {args.requests} of each kind, RESULTS_KEEP_S={args.keep:g}:",
        "",
        "| request | held at its end (median) | used_memory growth at the end, per request | held once stored "
        "(median) | held once stored (max) | used_memory growth after, per request |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    redis = aioredis.from_url(redis_url, decode_responses=True)
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=gateway, headers=headers, timeout=120) as http:
        for label, body in KINDS.items():
            await finish(http, body)  # warm up
            cells = await measure(http, redis, body, args.requests, args.keep)
            lines.append("| " + " | ".join([label, *cells]) + " |")
    await redis.aclose()
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--keep", type=float, default=5.0, help="RESULTS_KEEP_S of the stack's binder")
    args = parser.parse_args()
    with local_stack(RESULTS_KEEP_S=str(args.keep)) as stack:
        print(asyncio.run(run(args, stack.gateway, stack.redis, stack.api_key)))


if __name__ == "__main__":
    main()
