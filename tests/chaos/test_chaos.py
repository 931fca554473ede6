"""Chaos: under steady mixed load, SIGKILL in turn the binder, a gateway (the other takes
over), Triton (restarted), Redis (restarted from its append-only file) and the
MongoDB-wire server (down 30 s). After each:

- every accepted request reaches a terminal state within its deadline plus a bounded delay;
- exactly one MongoDB record per accepted request, and the results stream finished it once;
- the vector index holds exactly the stored embeddings;
- no event stream repeats or skips a token index, and its tokens join to the record's text;
- the only refusals are 503s (and 429s) with a stable code, or connection errors while a
  gateway is down.

A stack of its own (Redis, MongoDB-wire server, Triton, a binder, two gateways), so the
crashes touch nothing else. Bounded: about four minutes on two cores."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from pymongo import AsyncMongoClient

from gateway.protocol.redis_keys import Shard, shard_of
from gateway.server.tenants.cli import ensure_local_key
from gateway.stack.process import ManagedProcess, free_port, stop_processes
from gateway.stack.services import binder_spec, gateway_spec, mongo_spec, redis_spec

RESULTS_STREAM = Shard(0).results

pytestmark = pytest.mark.timeout(600)

DEADLINE_S = 120  # each request's timeout_s
DRAIN_BOUND_S = 60  # after the load stops, everything accepted must end within this
ALLOWED_REFUSALS = {(503, "redis_unavailable"), (503, "mongo_unavailable"), (503, "redis_full"), (429, "backlog_full")}


@dataclass
class Phase:
    name: str
    accepted: list[str] = field(default_factory=list)
    streamed: set[str] = field(default_factory=set)
    refused: Counter = field(default_factory=Counter)
    drain_s: float = 0.0
    report: dict = field(default_factory=dict)


@dataclass
class ChaosStack:
    data: Path
    env: dict[str, str]
    key: str
    redis_url: str
    mongo_url: str
    redis: ManagedProcess
    mongo: ManagedProcess
    triton: ManagedProcess
    binder: ManagedProcess
    binder_url: str
    gateways: dict[str, tuple[ManagedProcess, str]]
    down: set[str] = field(default_factory=set)  # gateways killed and not back yet

    def live_urls(self) -> list[str]:
        return [url for name, (_, url) in self.gateways.items() if name not in self.down]


def _start(spec) -> ManagedProcess:
    process = ManagedProcess(spec)
    process.start()
    process.wait_ready(time.monotonic() + 300)
    return process


@pytest.fixture(scope="module")
def chaos(stack, tmp_path_factory):
    data = tmp_path_factory.mktemp("chaos")
    started: list[ManagedProcess] = []
    redis_port, mongo_port = free_port(), free_port()
    redis = _start(redis_spec(data_dir=data, host="127.0.0.1", port=redis_port, name="redis-chaos"))
    started.append(redis)
    mongo = _start(mongo_spec(data_dir=data, host="127.0.0.1", port=mongo_port))
    started.append(mongo)
    redis_url, mongo_url = f"redis://127.0.0.1:{redis_port}/0", f"mongodb://127.0.0.1:{mongo_port}"
    key, _ = ensure_local_key(data / "api_key", mongo_url, "triton_gateway", tenant="chaos")
    metrics_port, grpc_port = free_port(), free_port()
    triton = _start(
        stack.launcher.triton("triton-chaos", http_port=free_port(), grpc_port=grpc_port, metrics_port=metrics_port)
    )
    started.append(triton)
    binder_port = free_port()
    env = {
        **stack.launcher.service_env,
        "REDIS_URL": redis_url,
        "MONGO_URL": mongo_url,
        "MONGO_TIMEOUT_S": "2",
        "TRITON_GRPC_URLS": f"127.0.0.1:{grpc_port}",
        "TRITON_METRICS_URLS": f"http://127.0.0.1:{metrics_port}/metrics",
        "BINDER_URLS": f"http://127.0.0.1:{binder_port}",
        "LOG_LEVEL": "WARNING",
        # The check below reads every streamed request's events after it is stored;
        # by default they leave Redis 30 s after that, before a slow machine gets there.
        "RESULTS_KEEP_S": "3600",
    }
    binder = _start(binder_spec(data_dir=data, host="127.0.0.1", port=binder_port, env=env, name="binder-chaos"))
    started.append(binder)
    gateways = {}
    for name in ("gw-a", "gw-b"):
        port = free_port()
        gateways[name] = (
            _start(gateway_spec(data_dir=data, host="127.0.0.1", port=port, env=env, name=name)),
            f"http://127.0.0.1:{port}",
        )
        started.append(gateways[name][0])
    handle = ChaosStack(
        data, env, key, redis_url, mongo_url, redis, mongo, triton, binder, f"http://127.0.0.1:{binder_port}", gateways
    )
    yield handle
    stop_processes(started)


BODIES = [
    {"model": "llm_synthetic", "inputs": {"text_input": "chaos stream", "max_tokens": 30}, "stream": True},
    {"model": "text_embed", "inputs": {"text": "a sentence to embed"}},
    # Many inputs, one request: one record, one document, a vector in the index per input.
    {"model": "text_embed", "inputs": {"text": ["chaos one", "chaos two", "chaos three"]}},
    {"model": "llm", "inputs": {"text_input": "Hello", "max_tokens": 6}},
    {"model": "llm_echo", "inputs": {"text_input": "echo 👋 世界 é", "max_tokens": 60}, "stream": True},
]


async def _load(chaos: ChaosStack, phase: Phase, stop: asyncio.Event, rate: float = 8.0) -> None:
    rng = random.Random(phase.name)
    headers = {"Authorization": f"Bearer {chaos.key}"}
    async with httpx.AsyncClient(headers=headers, timeout=30) as client:
        while not stop.is_set():
            urls = chaos.live_urls()
            body = {**rng.choice(BODIES), "timeout_s": DEADLINE_S}
            try:
                response = await client.post(f"{rng.choice(urls)}/infer", json=body)
                if response.status_code == 202:
                    phase.accepted.append(response.json()["request_id"])
                    if body.get("stream"):
                        phase.streamed.add(phase.accepted[-1])
                else:
                    phase.refused[(response.status_code, response.json()["error"]["code"])] += 1
            except httpx.TransportError:
                phase.refused[("connection", "")] += 1  # a gateway that was just killed
            await asyncio.sleep(rng.expovariate(rate))


async def _drain(chaos: ChaosStack, phase: Phase) -> list[dict]:
    """Every accepted request's final record, within the bound."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {chaos.key}"}
    records: dict[str, dict] = {}
    async with httpx.AsyncClient(headers=headers, timeout=60) as client:
        while len(records) < len(phase.accepted):
            assert time.monotonic() - started < DRAIN_BOUND_S + DEADLINE_S, (
                f"{phase.name}: {len(phase.accepted) - len(records)} requests not terminal"
            )
            url = chaos.live_urls()[0]
            for request_id in [r for r in phase.accepted if r not in records][:50]:
                try:
                    response = await client.get(f"{url}/results/{request_id}", params={"wait": 2})
                except httpx.TransportError:
                    continue
                if response.status_code == 200 and response.json()["status"] in (
                    "succeeded",
                    "failed",
                    "canceled",
                    "expired",
                ):
                    records[request_id] = response.json()
    phase.drain_s = time.monotonic() - started
    return list(records.values())


async def _check(chaos: ChaosStack, phase: Phase, records: list[dict]) -> None:
    ids = phase.accepted
    redis = aioredis.from_url(chaos.redis_url, decode_responses=True)
    mongo: AsyncMongoClient = AsyncMongoClient(chaos.mongo_url)
    try:
        collection = mongo["triton_gateway"]["results"]
        deadline = time.monotonic() + 60  # the binder stores what ended
        while (stored := await collection.count_documents({"_id": {"$in": ids}})) < len(ids):
            assert time.monotonic() < deadline, f"{phase.name}: {len(ids) - stored} of {len(ids)} never stored"
            await asyncio.sleep(0.5)
        finished = Counter(
            fields["id"] for _, fields in await redis.xrange(RESULTS_STREAM) if fields.get("id") in set(ids)
        )
        duplicates = sum(n - 1 for n in finished.values() if n > 1)
        for request_id in phase.streamed:
            await _check_tokens(redis, request_id, next(r for r in records if r["request_id"] == request_id))
    finally:
        await redis.aclose()
        await mongo.close()
    bad = {k: v for k, v in phase.refused.items() if k not in ALLOWED_REFUSALS and k[0] != "connection"}
    statuses = Counter(r["status"] for r in records)
    phase.report = {
        "phase": phase.name,
        "accepted": len(ids),
        "terminal": len(records),
        "records": stored,
        "duplicates": duplicates,
        "lost": len(ids) - len(records),
        "drain_s": round(phase.drain_s, 1),
        "statuses": dict(statuses),
        "refused": {f"{k[0]} {k[1]}".strip(): v for k, v in phase.refused.items()},
    }
    print(json.dumps(phase.report))
    assert not bad, f"{phase.name}: refusals without a stable outage code: {bad}"
    assert stored == len(ids) and duplicates == 0 and len(records) == len(ids)


async def _check_tokens(redis: aioredis.Redis, request_id: str, record: dict) -> None:
    events = await redis.xrange(shard_of(request_id).events(request_id))
    expected, text = 0, []
    for _, fields in events:
        if fields["event"] == "token":
            token = json.loads(fields["data"])
            assert token["index"] == expected, f"{request_id}: token index {token['index']}, expected {expected}"
            expected += token["count"]
            text.append(token["text_output"])
    if record["status"] == "succeeded":
        assert "".join(text) == record["outputs"]["text_output"], request_id


async def _index_matches_the_store(chaos: ChaosStack) -> None:
    mongo: AsyncMongoClient = AsyncMongoClient(chaos.mongo_url)
    try:
        embeddings = 0  # a vector per input: a many-input request's document holds several
        stored = mongo["triton_gateway"]["results"].find({"model": "text_embed", "status": "succeeded"}, {"outputs": 1})
        async for document in stored:
            vectors = (document.get("outputs") or {}).get("embedding")
            embeddings += int(vectors["shape"][0]) if isinstance(vectors, dict) else 1
    finally:
        await mongo.close()
    deadline = time.monotonic() + 30
    async with httpx.AsyncClient(timeout=10) as client:
        while True:
            health = (await client.get(f"{chaos.binder_url}/healthz")).json()
            indexed = _count(health.get("index", {}).get("minilm", 0))
            if indexed == embeddings or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
    assert indexed == embeddings, f"index holds {indexed} minilm vectors, MongoDB {embeddings} embeddings"


def _count(value: int | dict) -> int:
    return sum(value.values()) if isinstance(value, dict) else int(value)


async def _phase(chaos: ChaosStack, name: str, crash, recover, *, before_s: float = 6, during_s: float = 8) -> Phase:
    phase = Phase(name)
    stop = asyncio.Event()
    load = asyncio.create_task(_load(chaos, phase, stop))
    await asyncio.sleep(before_s)
    crash()
    await asyncio.sleep(during_s)
    await asyncio.to_thread(recover)
    await asyncio.sleep(4)  # load goes on across the recovery
    stop.set()
    await load
    records = await _drain(chaos, phase)
    await _check(chaos, phase, records)
    return phase


async def test_every_accepted_request_ends_once_through_crashes_of_each_part(chaos: ChaosStack) -> None:
    def restart(process: ManagedProcess) -> None:
        process.start()
        process.wait_ready(time.monotonic() + 300)

    gw_a = chaos.gateways["gw-a"][0]

    def kill_gateway() -> None:
        chaos.down.add("gw-a")
        gw_a.kill()

    def restart_gateway() -> None:
        restart(gw_a)
        chaos.down.discard("gw-a")

    reports = []
    for name, crash, recover in (
        ("binder", chaos.binder.kill, lambda: restart(chaos.binder)),
        ("gateway", kill_gateway, restart_gateway),
        ("triton", chaos.triton.kill, lambda: restart(chaos.triton)),
        ("redis", chaos.redis.kill, lambda: restart(chaos.redis)),
    ):
        reports.append((await _phase(chaos, name, crash, recover)).report)

    def mongo_down_30s() -> None:
        time.sleep(22)  # (the phase itself already waited 8 s after the kill)
        restart(chaos.mongo)

    reports.append((await _phase(chaos, "mongodb", chaos.mongo.kill, mongo_down_30s)).report)
    await _index_matches_the_store(chaos)
    (chaos.data / "chaos-report.json").write_text(json.dumps(reports, indent=2))
