"""An embeddings call to a model that counts its texts' tokens itself (num_tokens) is charged
an upper bound of them at admission, from the texts' lengths, and settles to the model's
count when it ends: the tenant's tokens per minute then hold that count, and what the bound
reserved beyond it is the tenant's again (app.token_counter, Quotas.unreserve)."""

from __future__ import annotations

import asyncio
import time

from limits import RateLimitItemPerMinute
from limits.aio.storage import RedisStorage
from limits.aio.strategies import SlidingWindowCounterRateLimiter

from tests.test_tenants import client_for, new_key, set_tenant

LIMIT = 1000  # tokens per minute: one call's bound and a settled call's count fit, two bounds do not
TEXTS = ["word " * 40] * 4  # by length 202 tokens each (with [CLS] [SEP]); text_embed counts 42
CALL = {"model": "text_embed", "input": TEXTS}


async def _tokens_used(stack, tenant: str) -> int:
    """The tenant's tokens-per-minute counter, read from Redis as the gateway's limiter keeps it."""
    storage = RedisStorage(stack.redis_url.replace("redis://", "async+redis://", 1))
    stats = await SlidingWindowCounterRateLimiter(storage).get_window_stats(
        RateLimitItemPerMinute(LIMIT), "tpm", tenant
    )
    return LIMIT - stats.remaining


async def _until_tokens_used(stack, tenant: str, tokens: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (used := await _tokens_used(stack, tenant)) != tokens:
        assert time.monotonic() < deadline, f"the counter holds {used} tokens, never {tokens}"
        await asyncio.sleep(0.05)


async def test_an_embeddings_calls_reservation_settles_to_the_models_count_when_it_ends(stack) -> None:
    tenant = "tenant-embed-settle"
    await set_tenant(stack, tenant, limits={"tokens_per_minute": LIMIT})
    async with client_for(stack, await new_key(stack, tenant)) as client:
        first = await client.post("/v1/embeddings", json=CALL)
        assert first.status_code == 200, first.text
        reserved = LIMIT - int(first.headers["x-ratelimit-remaining-tokens"])
        counted = first.json()["usage"]["prompt_tokens"]
        # (What makes the second call's admission tell: it fits beside the count, not beside the bound.)
        assert counted < reserved and counted + reserved <= LIMIT < 2 * reserved, (counted, reserved)
        await _until_tokens_used(stack, tenant, counted)  # settled when the call ended
        second = await client.post("/v1/embeddings", json=CALL)
    assert second.status_code == 200, second.text
