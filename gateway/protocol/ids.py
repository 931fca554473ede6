"""Request ids: 48 bits of milliseconds, then 128 random bits, in Crockford base32
(36 characters): unguessable, URL-safe, and sorted by creation time."""

from __future__ import annotations

import os
import re
import time

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_DIGIT = {char: value for value, char in enumerate(_CROCKFORD)}
REQUEST_ID_PATTERN = re.compile(r"^[0-9A-HJKMNP-TV-Z]{36}$")


def new_request_id(now: float | None = None) -> str:
    millis = int((time.time() if now is None else now) * 1000)
    value = (millis << 128) | int.from_bytes(os.urandom(16), "big")
    return "".join(_CROCKFORD[(value >> shift) & 31] for shift in range(175, -5, -5))


def valid_request_id(request_id: str) -> bool:
    return bool(REQUEST_ID_PATTERN.match(request_id))


def request_id_time(request_id: str) -> float | None:
    """When the id was made (seconds since the epoch), or None if it is not one of ours."""
    if not valid_request_id(request_id):
        return None
    value = 0
    for char in request_id:
        value = (value << 5) | _DIGIT[char]
    return (value >> 128) / 1000
