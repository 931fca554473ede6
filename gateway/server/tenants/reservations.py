"""Stored quotas held atomically: what a tenant is storing now (an upload, a new
conversation) is reserved in Redis beside its other reservations, counted with what it
keeps, and released once stored (or refused), so concurrent calls cannot all pass one
quota. A reservation whose caller never released it (its gateway died) lapses."""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from redis.asyncio import Redis

# A reservation never released lapses after this.
RESERVATION_TTL_MS = 15 * 60 * 1000
# A released reservation stays as a mark this long: what it stored may be missing from a
# count of what is kept that began before it was stored, so a reservation checked with
# such a count counts the marks released since that count began (none older than this).
RELEASED_KEEP_MS = 60 * 1000

# KEYS: the reservations (a hash: id -> `<bytes>:<expires at, ms>`, or once released
# `R<bytes>:<released at, ms>`). ARGV: reservation id, its bytes, now (ms), its TTL (ms),
# what is kept (count, bytes), the most (count, bytes; 0: none), when the count of what is
# kept began (ms). Reserved only if it fits beside what is kept, every other reservation
# and what was released since the count began: {1}, or {0, 'count' | 'bytes', what is
# used with the reservations}.
RESERVE = """
local now, began = tonumber(ARGV[3]), tonumber(ARGV[9])
local held, bytes = 0, 0
local found = redis.call('HGETALL', KEYS[1])
for i = 1, #found, 2 do
  local released, size, at = string.match(found[i + 1], '^(R?)(%d+):(%d+)$')
  at = tonumber(at)
  if released == 'R' then
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


@dataclass(frozen=True)
class Over:
    """A reservation refused: which quota ('count' or 'bytes') and what is used of it,
    the other reservations included."""

    kind: str
    used: int


def now_ms() -> int:
    return int(time.time() * 1000)


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
) -> Release | Over:
    """Reserve one thing of `size` bytes under `key` (a tenant's, with its hash tag) beside
    what is kept (counted from counted_at_ms, now_ms() before the count began) and the other
    reservations; its release, or Over. The caller releases it once what it reserved is
    stored, or refused."""
    reservation = secrets.token_hex(8)
    reply = await redis.eval(
        RESERVE,
        1,
        key,
        reservation,
        size,
        now_ms(),
        RESERVATION_TTL_MS,
        kept,
        kept_bytes,
        max_count,
        max_bytes,
        counted_at_ms,
        RELEASED_KEEP_MS,
    )
    if int(reply[0]) == 0:
        kind = reply[1].decode() if isinstance(reply[1], bytes) else str(reply[1])
        return Over(kind, int(reply[2]))

    async def release() -> None:
        await redis.hset(key, reservation, f"R{size}:{now_ms()}")

    return release
