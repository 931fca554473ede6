"""What the SSE event hub costs as the streams it follows grow (issue 30): one gateway
process's `EventHub` following F requests' event streams of one shard, while another
process publishes token events into them through the real EMIT script, as a gateway's
relay does (one call a window of 10 ms, one event for each stream that has a token in
it), on a Redis of its own (the stack's settings).

The followers come at once, each stream holding one event already: a row first says how
long after the first follower came the last one had that event ("a burst settled in"),
and what the burst cost Redis (its commands a follower: FOLLOW, the interrupts of the
blocked read, the reads). The event rate is the same in every row (`--events` a second,
spread over the streams in turn), so a row's figures differ by the number of streams
followed only. Each row: this process's CPU an event (the hub, and the followers taking their events off their
queues), Redis's CPU an event (INFO cpu), its commands an event and the costliest of
them (INFO commandstats), and the time from the EMIT call to a follower holding the event
(p50, p99).

Run:  .venv/bin/python -m bench.event_hub
      .venv/bin/python -m bench.event_hub --streams 40,200,1000,3000 --events 4000 --seconds 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import statistics
import time
from typing import Any

import uvloop
from redis.asyncio import Redis

from bench.redis_info import RedisSample, RedisWindow
from bench.stack import lone_redis
from gateway.common.redis import RedisClients
from gateway.protocol.ids import new_request_id
from gateway.protocol.redis_keys import Shard, shard_of
from gateway.server.queue.jobs import JobStore, TokenEvent
from gateway.server.results.events import NAMED_MOST, EventHub

WINDOW_S = 0.01
RUN = "bench-run"


def publish(url: str, ids: list[str], events_a_second: int, seconds: float) -> None:
    """Token events into the streams of ids, one EMIT call a window, in turn (the relay's
    JobStore.emit_many); the text is the time of the call (for the followers' latency)."""
    asyncio.run(_publish(url, ids, events_a_second, seconds))


async def _publish(url: str, ids: list[str], events_a_second: int, seconds: float) -> None:
    client = Redis.from_url(url, decode_responses=True)
    jobs = JobStore(client, idempotency_ttl_s=60)
    shard = shard_of(ids[0])
    per_window = max(1, min(len(ids), round(events_a_second * WINDOW_S)))
    pieces = dict.fromkeys(ids, 0)
    turn = 0
    start = time.monotonic()
    next_window = start
    while time.monotonic() - start < seconds:
        events = []
        sent = f"{time.time():.6f}"
        for _ in range(per_window):
            rid = ids[turn % len(ids)]
            turn += 1
            events.append(TokenEvent(rid, RUN, pieces[rid], sent, 1, []))
            pieces[rid] += 1
        await jobs.emit_many(shard, events)
        next_window += WINDOW_S
        await asyncio.sleep(max(0.0, next_window - time.monotonic()))
    await client.aclose()


async def follow(hub: EventHub, rid: str, latencies: list[float], arrived: list[float]) -> None:
    async for event in hub.follow(rid, "0-0", tenant=None):
        if event.kind == "token":
            latencies.append(time.time() - float(json.loads(event.data)["text_output"]))
        else:  # the event the stream held before its follower came
            arrived.append(time.monotonic())


async def measure(url: str, streams: int, named_most: int, events: int, seconds: float) -> dict[str, Any]:
    shard = Shard(0)
    ids = [new_request_id(shard=0) for _ in range(streams)]
    setup = Redis.from_url(url, decode_responses=True)
    async with setup.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.hset(shard.request(rid), mapping={"state": "running", "run": RUN, "emitted": 0})
            pipe.xadd(shard.events(rid), {"event": "running", "data": "{}"})
        await pipe.execute()
    clients = RedisClients.open(url=url, cluster_nodes=[], timeout_s=5.0, max_connections=8)

    async def no_record(request_id: str, entry: str) -> str:
        return "{}"

    jobs = JobStore(clients.main, idempotency_ttl_s=60, replication=clients)  # FOLLOW as the gateway sends it
    hub = EventHub(clients.unblocker(), clients.reader, no_record, jobs.follow, named_most=named_most)
    latencies: list[float] = []
    arrived: list[float] = []
    burst_before, came = RedisSample.at(url), time.monotonic()
    followers = [asyncio.create_task(follow(hub, rid, latencies, arrived)) for rid in ids]
    async with asyncio.timeout(120):
        while len(arrived) < streams:
            await asyncio.sleep(0.005)
    settled_ms = (max(arrived) - came) * 1e3
    burst = RedisWindow.between(burst_before, RedisSample.at(url))
    publisher = multiprocessing.get_context("spawn").Process(target=publish, args=(url, ids, events, seconds))
    redis_before = RedisSample.at(url)
    cpu_before = time.process_time()
    publisher.start()
    await asyncio.to_thread(publisher.join)
    cpu = time.process_time() - cpu_before
    window = RedisWindow.between(redis_before, RedisSample.at(url))
    received = len(latencies)
    for task in followers:
        task.cancel()
    await asyncio.gather(*followers, return_exceptions=True)
    await hub.close()
    await clients.aclose()
    async with setup.pipeline(transaction=False) as pipe:
        for rid in ids:
            pipe.delete(shard.request(rid), shard.events(rid), shard.tokens(rid))
        pipe.delete(shard.notices)
        await pipe.execute()
    await setup.aclose()
    latencies.sort()
    costliest = [(name, usec / max(received, 1)) for name, usec in window.usec.most_common(3)]
    return {
        "settled_ms": settled_ms,
        "burst_commands": sum(burst.calls.values()) / streams,
        "received": received,
        "cpu_us": cpu * 1e6 / max(received, 1),
        "redis_us": window.cpu_s * 1e6 / max(received, 1),
        "commands": sum(window.calls.values()) / max(received, 1),
        "p50_ms": statistics.median(latencies) * 1e3 if latencies else 0.0,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1e3 if latencies else 0.0,
        "costliest": costliest,
    }


async def main(args: argparse.Namespace) -> None:
    print(f"Events: {args.events} a second for {args.seconds:.0f} s, one EMIT a window of {WINDOW_S * 1e3:.0f} ms")
    print()
    print("| streams followed | the hub reads | a burst settled in ms | Redis commands a follower "
          "| events received | hub process CPU µs an event | Redis CPU µs an event "
          "| Redis commands an event | the costliest (µs an event) | latency p50 ms | p99 ms |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with lone_redis("bench-event-hub") as url:
        for _ in range(args.rounds):
            for streams in args.streams:
                for way in args.ways:
                    named_most = {"as set": NAMED_MOST, "named": 10**9, "by notices": 0}[way]
                    r = await measure(url, streams, named_most, args.events, args.seconds)
                    costliest = ", ".join(f"{name} {usec:.1f}" for name, usec in r["costliest"])
                    read = way if way != "as set" else ("named" if streams <= NAMED_MOST else "by notices")
                    print(f"| {streams} | {read} | {r['settled_ms']:.0f} | {r['burst_commands']:.1f} "
                          f"| {r['received']:.0f} | {r['cpu_us']:.1f} | {r['redis_us']:.1f} "
                          f"| {r['commands']:.2f} | {costliest} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} |")  # fmt: skip


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[40, 200, 1000, 3000])
    parser.add_argument("--events", type=int, default=4000, help="token events a second, all streams together")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--ways",
        type=lambda s: s.split(","),
        default=["as set", "named"],
        help="'as set': the hub as the gateway runs it (by notices past NAMED_MOST streams); "
        "'named': every stream named in one blocking XREAD, however many (as before notices); "
        "'by notices': by notices however few",
    )
    uvloop.run(main(parser.parse_args()))
