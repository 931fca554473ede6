"""Stored quotas held atomically: what a tenant is storing now (an upload, a new
conversation, a batch, an API key) is reserved in Redis beside its other reservations,
counted with what it keeps, and released once stored (or refused), so concurrent calls
cannot all pass one quota. A reservation may be resized while it is held (an upload's
reservation grows with the bytes that arrive, and is settled to its file's size before it
is stored), each growth checked against the quota as atomically as the reservation was.
A reservation whose caller never released it (its gateway died) lapses."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from redis.asyncio import Redis

# A reservation never released lapses after this.
RESERVATION_TTL_MS = 15 * 60 * 1000
# A released reservation stays as a mark this long: what it stored may be missing from a
# count of what is kept that began before it was stored, so a reservation checked with
# such a count counts the marks released since that count began (none older than this).
RELEASED_KEEP_MS = 60 * 1000
# A reservation resized this long after what is kept was counted counts it again first
# (given a way to): marks older than RELEASED_KEEP_MS are gone from the count's view.
RECOUNT_AFTER_MS = RELEASED_KEEP_MS // 2

# KEYS: the reservations (a hash: id -> `<bytes>:<expires at, ms>`, or once released
# `R<bytes>:<released at, ms>`). ARGV: reservation id, its bytes, now (ms), its TTL (ms),
# what is kept (count, bytes), the most (count, bytes; 0: none), when the count of what is
# kept began (ms), how long a released mark stays (ms). Reserved only if it fits beside
# what is kept, every other reservation and what was released since the count began:
# {1}, or {0, 'count' | 'bytes', what is used with the reservations}. The id's own entry,
# when it is held already, is not counted (a resize); one that shrinks always fits; one
# released stays released ({0, 'released', 0}).
RESERVE = """
local now, began = tonumber(ARGV[3]), tonumber(ARGV[9])
local own = redis.call('HGET', KEYS[1], ARGV[1])
if own then
  local released, size = string.match(own, '^(R?)(%d+):')
  if released == 'R' then return {0, 'released', 0} end
  if tonumber(ARGV[2]) <= tonumber(size) then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now + tonumber(ARGV[4])))
    redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[4]), tonumber(ARGV[10])))
    return {1}
  end
end
local held, bytes = 0, 0
local found = redis.call('HGETALL', KEYS[1])
for i = 1, #found, 2 do
  local released, size, at = string.match(found[i + 1], '^(R?)(%d+):(%d+)$')
  at = tonumber(at)
  if found[i] == ARGV[1] then
    -- its own entry: what it held is replaced by what it asks
  elseif released == 'R' then
    if at + tonumber(ARGV[10]) <= now then
      redis.call('HDEL', KEYS[1], found[i])
    elseif at > began then
      held, bytes = held + 1, bytes + tonumber(size)
    end
  elseif at <= now then
    redis.call('HDEL', KEYS[1], found[i])
  else
    held, bytes = held + 1, bytes + tonumber(size)
  end
end
local count, used = tonumber(ARGV[5]) + held, tonumber(ARGV[6]) + bytes
local max_count, max_bytes = tonumber(ARGV[7]), tonumber(ARGV[8])
if max_count > 0 and count + 1 > max_count then return {0, 'count', count} end
if max_bytes > 0 and used + tonumber(ARGV[2]) > max_bytes then return {0, 'bytes', used} end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2] .. ':' .. (now + tonumber(ARGV[4])))
redis.call('PEXPIRE', KEYS[1], math.max(tonumber(ARGV[4]), tonumber(ARGV[10])))
return {1}
"""

Release = Callable[[], Awaitable[None]]
# What a tenant keeps now: (count, bytes).
Count = Callable[[], Awaitable[tuple[int, int]]]


@dataclass(frozen=True)
class Over:
    """A reservation refused: which quota ('count' or 'bytes') and what is used of it,
    the other reservations included."""

    kind: str
    used: int


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class _Quota:
    """What a reservation is checked against: the key of the tenant's reservations, what it
    keeps (counted from counted_at_ms), and the most it may keep (0: no limit)."""

    key: str
    kept: int
    kept_bytes: int
    counted_at_ms: int
    max_count: int
    max_bytes: int


async def _reserve(redis: Redis, quota: _Quota, reservation: str, size: int) -> Over | None:
    reply = await redis.eval(
        RESERVE,
        1,
        quota.key,
        reservation,
        size,
        now_ms(),
        RESERVATION_TTL_MS,
        quota.kept,
        quota.kept_bytes,
        quota.max_count,
        quota.max_bytes,
        quota.counted_at_ms,
        RELEASED_KEEP_MS,
    )
    if int(reply[0]) == 1:
        return None
    kind = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
    return Over(kind, int(reply[2]))


class Reservation:
    """One thing reserved under a tenant's quota: resized while it is held, released once
    (calling it releases it too, as a Release). Released, it is a mark of its last size."""

    def __init__(self, redis: Redis, quota: _Quota, reservation: str, size: int, recount: Count | None) -> None:
        self.redis, self.quota, self.id, self.size = redis, quota, reservation, size
        self.recount = recount
        self.released = False

    async def resize(self, size: int) -> Over | None:
        """Hold size bytes instead, checked beside what is kept (counted again first when
        its count is older than RECOUNT_AFTER_MS and the reservation can) and the other
        reservations: None, or Over when a growth does not fit, the size held unchanged
        then. A shrink always fits."""
        if self.released:
            return Over("released", 0)
        if size > self.size and self.recount is not None and now_ms() - self.quota.counted_at_ms > RECOUNT_AFTER_MS:
            counted_at_ms = now_ms()
            kept, kept_bytes = await self.recount()
            self.quota = replace(self.quota, kept=kept, kept_bytes=kept_bytes, counted_at_ms=counted_at_ms)
        over = await _reserve(self.redis, self.quota, self.id, size)
        if over is None:
            self.size = size
        return over

    async def release(self) -> None:
        """Released, once: a second call does nothing."""
        if self.released:
            return
        self.released = True
        await self.redis.hset(self.quota.key, self.id, f"R{self.size}:{now_ms()}")

    async def __call__(self) -> None:
        await self.release()


async def reserve(
    redis: Redis,
    key: str,
    *,
    kept: int,
    kept_bytes: int,
    counted_at_ms: int,
    size: int,
    max_count: int,
    max_bytes: int,
    recount: Count | None = None,
) -> Reservation | Over:
    """Reserve one thing of `size` bytes under `key` (a tenant's, with its hash tag) beside
    what is kept (counted from counted_at_ms, now_ms() before the count began) and the other
    reservations; its Reservation, or Over. recount: how to count what is kept again, for a
    reservation resized long after (an upload's). The caller releases it once what it
    reserved is stored, or refused."""
    quota = _Quota(key, kept, kept_bytes, counted_at_ms, max_count, max_bytes)
    reservation = secrets.token_hex(8)
    over = await _reserve(redis, quota, reservation, size)
    return over if over is not None else Reservation(redis, quota, reservation, size, recount)
