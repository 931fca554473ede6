"""prompt_cache_key affinity is the tenant's own: a tenant's requests with one key keep to
one replica (route.reason `cache_key`), while another tenant sending the same string learns
nothing from its route (no `cache_key` reason: it was never used by this tenant) and, the
key being another in the prefix index, cannot steer load onto the replica it names."""

from __future__ import annotations

import secrets

from tests.gateway_calls import submit, wait_result
from tests.test_tenants import client_for, new_key


def keyed(key: str, n: int) -> dict:
    # Short prompts: no whole block to route by, so only the cache key can match.
    return {
        "model": "llm_synthetic",
        "inputs": {"text_input": f"question {n}", "max_tokens": 2},
        "parameters": {"prompt_cache_key": key},
    }


async def routed(stack, key: str, tenant: str, n: int) -> dict:
    async with client_for(stack, await new_key(stack, tenant)) as client:
        record = await wait_result(client, await submit(client, keyed(key, n)))
    assert record["status"] == "succeeded", record
    return record["route"]


async def test_another_tenants_prompt_cache_key_is_not_matched_by_the_same_string(stack) -> None:
    guessed = f"session-{secrets.token_hex(4)}"
    await routed(stack, guessed, "tenant-cache-key-owner", 1)
    assert (await routed(stack, guessed, "tenant-cache-key-owner", 2))["reason"] == "cache_key"  # its own affinity
    assert (await routed(stack, guessed, "tenant-cache-key-prober", 3))["reason"] != "cache_key"
