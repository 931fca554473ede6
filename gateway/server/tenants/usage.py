"""Usage per tenant and day, in Redis (kept 90 days): requests by outcome, prompt and
completion tokens. Read back at GET /usage (a tenant's own) and /admin/tenants/<t>/usage.

Counts are added up in memory and written every FLUSH_S (one pipeline for all tenants),
not once per request: a gateway killed without stopping loses at most that much of its
counting (the records in MongoDB stay the account of what was done)."""

from __future__ import annotations

import asyncio
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio import Redis

from gateway.protocol import ResultRecord

KEEP_S = 90 * 86400
FLUSH_S = 0.5


def _key(tenant: str, day: str) -> str:
    return f"usage:{tenant}:{day}"


class UsageLedger:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._pending: dict[str, Counter[str]] = {}

    def add(self, record: ResultRecord) -> None:
        """Count a finished request (written with the next flush)."""
        day = (record.finished_at or datetime.now(UTC)).strftime("%Y-%m-%d")
        counts = self._pending.setdefault(_key(record.tenant, day), Counter())
        counts["requests"] += 1
        counts[f"requests_{record.status.value}"] += 1
        if record.usage is not None:
            counts["prompt_tokens"] += record.usage.prompt_tokens
            counts["completion_tokens"] += record.usage.completion_tokens

    def count(self, tenant: str, name: str, amount: int = 1) -> None:
        """Count something a tenant used other than a finished request (`searches`), today
        (written with the next flush)."""
        day = datetime.now(UTC).strftime("%Y-%m-%d")
        self._pending.setdefault(_key(tenant, day), Counter())[name] += amount

    async def flush(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending:
            return
        sent: list[tuple[str, str, int] | None] = []
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                for key, counts in pending.items():
                    for field, value in counts.items():
                        if value:
                            pipe.hincrby(key, field, value)
                            sent.append((key, field, value))
                    pipe.expire(key, KEEP_S)
                    sent.append(None)
                results = await pipe.execute(raise_on_error=False)
        except Exception:
            for key, counts in pending.items():  # nothing went out: kept for the next flush
                self._pending.setdefault(key, Counter()).update(counts)
            raise
        # A pipeline spread over a cluster's nodes can fail in part: only what failed is
        # counted again next time.
        for item, result in zip(sent, results, strict=True):
            if item is not None and isinstance(result, Exception):
                key, field, value = item
                self._pending.setdefault(key, Counter())[field] += value

    async def run(self) -> None:
        """Flush every FLUSH_S (supervised: returns only by failing)."""
        while True:
            await asyncio.sleep(FLUSH_S)
            await self.flush()

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
