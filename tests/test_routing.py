"""KV-cache-aware routing over two real replicas: a shared prefix goes where its blocks
are, load imbalance spills it elsewhere, a restarted replica's blocks are forgotten, and
two gateways route as one (their prefix index is shared in Redis). The synthetic engine
(llm_synthetic) stands in for the model, so only routing is under test."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from gateway.protocol.records import replica_name
from tests.conftest import AUTH
from tests.gateway_calls import submit, wait_result

PREFIX = " ".join(f"rule {i}: keep answers short and kind." for i in range(60))  # ~16 blocks


def body(question: str, max_tokens: int = 4) -> dict:
    return {"model": "llm_synthetic", "inputs": {"text_input": f"{PREFIX}\nQ: {question}", "max_tokens": max_tokens}}


async def run(client: httpx.AsyncClient, question: str, max_tokens: int = 4) -> dict:
    return await wait_result(client, await submit(client, body(question, max_tokens)))


async def _until(check, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.2)


@pytest.fixture(scope="module")
def two_replicas(stack):
    second, second_url = stack.start_triton("triton-route")
    redis_url = stack.redis_db_url(60)
    env = {"REDIS_URL": redis_url, "ROUTE_BALANCE_ABS": "6", **stack.replicas_env(stack.triton_grpc, second_url)}
    first_gateway, first_url = stack.start_gateway("gateway-route-a", **env)
    second_gateway, other_url = stack.start_gateway("gateway-route-b", **env)
    yield {
        "urls": (first_url, other_url),
        "replicas": (stack.triton_grpc, second_url),
        "second": second,
    }
    stack.stop(first_gateway)
    stack.stop(second_gateway)
    stack.stop(second)


async def _both_ready(client: httpx.AsyncClient) -> bool:
    """Both replicas in rotation, by the gateway's own gauge."""
    lines = [
        line for line in (await client.get("/metrics")).text.splitlines() if line.startswith("gateway_replica_healthy{")
    ]
    return len(lines) == 2 and all(line.endswith(" 1.0") for line in lines)


def prompt(topic: str, question: str) -> dict:
    text = " ".join(f"{topic} {i}: keep answers short and kind." for i in range(50))
    return {"model": "llm_synthetic", "inputs": {"text_input": f"{text}\nQ: {question}", "max_tokens": 2}}


async def test_requests_sharing_a_prefix_go_to_the_replica_that_holds_it(two_replicas) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=two_replicas["urls"][0], timeout=60) as client:
        await _until(lambda: _both_ready(client))
        first = await run(client, "what is a gateway?")
        holder = first["replica"]
        later = [await run(client, f"question {i}?") for i in range(6)]
    assert {r["replica"] for r in later} == {holder}
    for record in later:
        assert record["route"]["reason"] == "prefix"
        assert record["route"]["matched_blocks"] >= record["route"]["prompt_blocks"] - 2


async def test_under_strong_imbalance_they_spill_to_the_other_replica(two_replicas) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=two_replicas["urls"][0], timeout=120) as client:
        await _until(lambda: _both_ready(client))
        holder = (await run(client, "who holds the prefix?"))["replica"]
        # Long generations with the shared prefix pile up on its holder ...
        ids = [await submit(client, body(f"long {i}", max_tokens=150)) for i in range(16)]
        records = await asyncio.gather(*(wait_result(client, rid, timeout=120) for rid in ids))
    replicas = {r["replica"] for r in records}
    assert replicas == {replica_name(url) for url in two_replicas["replicas"]}, "nothing spilled to the idle replica"
    spilled = [r for r in records if r["replica"] != holder]  # in the order they were submitted
    # The first spilled by the imbalance rule, or because the holder's decode load outweighed
    # the prefill it would save; later ones may follow the prefix it left there.
    assert spilled[0]["route"]["reason"] in ("imbalance", "load")
    assert all(r["route"]["reason"] in ("imbalance", "load", "prefix") for r in spilled)


async def test_two_gateways_route_a_shared_prefix_alike(two_replicas) -> None:
    first_url, other_url = two_replicas["urls"]
    async with (
        httpx.AsyncClient(headers=AUTH, base_url=first_url, timeout=60) as a,
        httpx.AsyncClient(headers=AUTH, base_url=other_url) as b,
    ):
        await _until(lambda: _both_ready(b))
        via_a = await wait_result(a, await submit(a, prompt("policy", "seen by the first gateway")))
        via_b = await wait_result(b, await submit(b, prompt("policy", "seen by the second gateway")))
    assert via_b["replica"] == via_a["replica"]
    assert via_b["route"]["reason"] == "prefix" and via_b["route"]["matched_blocks"] > 0


async def test_a_restarted_replica_loses_its_prefix_blocks_in_the_index(two_replicas) -> None:
    second = two_replicas["second"]
    second_url = two_replicas["replicas"][1]
    async with httpx.AsyncClient(headers=AUTH, base_url=two_replicas["urls"][0], timeout=60) as client:
        await _until(lambda: _both_ready(client))
        # New prefixes go round the replicas: find one the second replica holds.
        for attempt in range(8):
            topic = f"fact set {attempt}"
            record = await wait_result(client, await submit(client, prompt(topic, "first")))
            if record["replica"] == replica_name(second_url):
                break
        assert record["replica"] == replica_name(second_url)
        again = await wait_result(client, await submit(client, prompt(topic, "second")))
        assert again["replica"] == replica_name(second_url) and again["route"]["matched_blocks"] > 0

        second.stop()
        second.start()  # same ports, an empty KV cache
        second.wait_ready(time.monotonic() + 240)
        await _until(lambda: _both_ready(client))
        after = await wait_result(client, await submit(client, prompt(topic, "after the restart")))
    assert after["route"]["matched_blocks"] == 0
    assert after["route"]["reason"] != "prefix"
