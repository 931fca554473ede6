"""Usage per tenant and day, in Redis (kept 90 days): requests by outcome, prompt and
completion tokens. Read back at GET /usage (a tenant's own) and /admin/tenants/<t>/usage."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio import Redis

from gateway.protocol import ResultRecord

KEEP_S = 90 * 86400


def _key(tenant: str, day: str) -> str:
    return f"usage:{tenant}:{day}"


class UsageLedger:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    async def add(self, record: ResultRecord) -> None:
        day = (record.finished_at or datetime.now(UTC)).strftime("%Y-%m-%d")
        key = _key(record.tenant, day)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(key, "requests", 1)
            pipe.hincrby(key, f"requests_{record.status.value}", 1)
            if record.usage is not None:
                pipe.hincrby(key, "prompt_tokens", record.usage.prompt_tokens)
                pipe.hincrby(key, "completion_tokens", record.usage.completion_tokens)
            pipe.expire(key, KEEP_S)
            await pipe.execute()

    async def read(self, tenant: str, days: int) -> dict[str, Any]:
        today = datetime.now(UTC).date()
        names = [(today - timedelta(days=n)).isoformat() for n in range(days)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for day in names:
                pipe.hgetall(_key(tenant, day))
            rows = await pipe.execute()
        per_day: list[dict[str, Any]] = []
        totals: dict[str, int] = {}
        for day, row in zip(names, rows, strict=True):
            counts = {key: int(value) for key, value in row.items()}
            per_day.append({"date": day, **counts})
            for key, value in counts.items():
                totals[key] = totals.get(key, 0) + value
        return {"tenant": tenant, "days": days, "totals": totals, "daily": per_day}
