"""Redis Streams helpers shared by the gateway and the binder."""

from __future__ import annotations

import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError


def stream_id_order(entry_id: str) -> tuple[int, int]:
    millis, _, seq = entry_id.partition("-")
    return int(millis), int(seq or 0)


async def ensure_group(redis: Redis, stream: str, group: str, start: str = "0") -> None:
    try:
        await redis.xgroup_create(stream, group, id=start, mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def trim_acknowledged(redis: Redis, stream: str, group: str, keep_newer_than_s: float = 0) -> None:
    """Drop only entries the group has delivered and acknowledged: everything older than
    both its oldest pending entry and its last delivered one (and than the window)."""
    groups = await redis.xinfo_groups(stream)
    info = next((g for g in groups if g["name"] == group), None)
    if info is None:
        return
    bounds = [info["last-delivered-id"]]
    pending = await redis.xpending(stream, group)
    if pending["pending"]:
        bounds.append(pending["min"])
    if keep_newer_than_s:
        bounds.append(f"{int((time.time() - keep_newer_than_s) * 1000)}-0")
    await redis.xtrim(stream, minid=min(bounds, key=stream_id_order), approximate=True)
