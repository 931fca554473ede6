"""Request ids: 48 bits of milliseconds, then 128 random bits, in Crockford base32
(36 characters): unguessable, URL-safe, and sorted by creation time.

The lowest SHARD_BITS of the random part name the Redis shard that holds the request
(gateway.protocol.redis_keys), so any process finds a request's keys from its id alone,
whatever the number of shards is now. 118 bits stay random."""

from __future__ import annotations

import os
import re
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DIGIT = {char: value for value, char in enumerate(_CROCKFORD)}
REQUEST_ID_PATTERN = re.compile(r"^[0-9A-HJKMNP-TV-Z]{36}$")
SHARD_BITS = 10
MAX_SHARDS = 1 << SHARD_BITS


def new_request_id(now: float | None = None, shard: int = 0) -> str:
    if not 0 <= shard < MAX_SHARDS:
        raise ValueError(f"shard must be in [0, {MAX_SHARDS})")
    millis = int((time.time() if now is None else now) * 1000)
    random_bits = (int.from_bytes(os.urandom(16), "big") >> SHARD_BITS << SHARD_BITS) | shard
    value = (millis << 128) | random_bits
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(175, -5, -5))


def valid_request_id(request_id: str) -> bool:
    return bool(REQUEST_ID_PATTERN.match(request_id))


def _value(request_id: str) -> int:
    value = 0
    for char in request_id:
        value = (value << 5) | _DIGIT[char]
    return value


def request_id_time(request_id: str) -> float | None:
    """When the id was made (seconds since the epoch), or None if it is not one of ours."""
    if not valid_request_id(request_id):
        return None
    return (_value(request_id) >> 128) / 1000


def request_id_shard(request_id: str) -> int:
    """The shard that holds the request (0 for a string that is not one of our ids)."""
    if not valid_request_id(request_id):
        return 0
    # The last two characters carry the lowest 10 bits.
    return ((_DIGIT[request_id[-2]] << 5) | _DIGIT[request_id[-1]]) & (MAX_SHARDS - 1)
