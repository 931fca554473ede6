"""Long prompts are tokenized in a bounded pool of their own, one tenant holding at most its
share of it (gateway.server.models.tokenize_pool), against a gateway process of this
module's own: one thread, three places waiting, two places a tenant. One tenant's many
long prompts at once: past its share they are 429 tenant_share_exceeded with
Retry-After, while another tenant's long prompt gets its place and its short request is
served; meanwhile the process's event loop is never held over 100 ms (tests/bounds.py).
The work runs in the pool's named threads, never the loop's default executor."""

from __future__ import annotations

import asyncio
import random
import string
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.server.models.base import LONG_INPUT_CHARS
from gateway.server.models.tokenize_pool import THREAD_NAME_PREFIX, off_the_loop_if_long
from tests.bounds import Watch
from tests.test_tenants import client_for, new_key, set_tenant


@pytest.fixture(scope="module")
def lone(stack) -> Iterator[tuple[str, int]]:
    """(url, pid) of a gateway of one process whose tokenize pool is one thread, three
    places waiting and half of the four places a tenant."""
    process, url = stack.start_gateway(
        "gateway-tokenize-pool",
        GATEWAY_WORKERS="1",
        TOKENIZE_THREADS="1",
        TOKENIZE_QUEUE="3",
        TENANT_TOKENIZE_SHARE="0.5",
    )
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


def _long_prompt(seed: int) -> dict[str, Any]:
    """90,000 characters of random words: ~0.3 s of the tiny GPT-2 tokenizer on the 2-core
    machine, past llm_echo's context once counted (422 prompt_too_long, after the work)."""
    rng = random.Random(seed)
    words = ("".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9))) for _ in range(20_000))
    return {"model": "llm_echo", "inputs": {"text_input": " ".join(words)[:90_000], "max_tokens": 8}}


SHORT = {"model": "llm_echo", "inputs": {"text_input": "a short prompt, served at once", "max_tokens": 8}}


async def _tenant(stack, name: str, url: str) -> httpx.AsyncClient:
    await set_tenant(stack, name, limits={"requests_per_minute": 10_000})
    return client_for(stack, await new_key(stack, name), url)


async def test_a_tenant_past_its_share_of_the_tokenize_pool_is_429_while_another_is_served(stack, lone) -> None:
    url, pid = lone
    flooding = await _tenant(stack, "tenant-tokenize-flood", url)
    other = await _tenant(stack, "tenant-tokenize-other", url)
    async with flooding, other:
        with Watch(url, pid) as seen:
            floods = [flooding.post("/infer", json=_long_prompt(i)) for i in range(10)]
            others = [
                other.post("/infer", json=_long_prompt(100)),
                other.post("/infer", json=SHORT, headers={"Prefer": "wait=60"}),
            ]
            *flooded, other_long, other_short = await asyncio.gather(*floods, *others)
    refused = [r for r in flooded if r.status_code == 429]
    assert refused, [r.status_code for r in flooded]
    for response in refused:
        assert response.json()["error"]["code"] == "tenant_share_exceeded", response.text
        assert response.headers["retry-after"]
    # The others were tokenized (and found too long for the model), none refused otherwise.
    assert {r.json()["error"]["code"] for r in flooded if r.status_code != 429} == {"prompt_too_long"}
    assert other_long.status_code == 422 and other_long.json()["error"]["code"] == "prompt_too_long"
    assert other_short.status_code == 200, other_short.text
    assert seen.pauses == 0, seen


async def test_long_work_runs_in_the_pools_named_threads_not_the_default_executor() -> None:
    name = await off_the_loop_if_long(
        {"text_input": "x" * (LONG_INPUT_CHARS + 1)}, lambda: threading.current_thread().name, tenant="t"
    )
    assert name.startswith(THREAD_NAME_PREFIX)  # the default executor's are asyncio_N
