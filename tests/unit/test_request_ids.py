"""Request ids: Crockford base32 of 48 bits of milliseconds and 128 random bits, the
lowest bits naming the shard (gateway.protocol.ids)."""

from __future__ import annotations

from gateway.protocol.ids import (
    _CROCKFORD,
    MAX_SHARDS,
    REQUEST_ID_PATTERN,
    new_request_id,
    request_id_shard,
    request_id_time,
)


def _value(request_id: str) -> int:
    value = 0
    for char in request_id:
        value = (value << 5) | _CROCKFORD.index(char)
    return value


def test_an_id_is_36_crockford_digits_of_its_time_and_random_bits() -> None:
    request_id = new_request_id(1_764_000_000.123, shard=5)
    assert REQUEST_ID_PATTERN.match(request_id)
    assert _value(request_id) >> 128 == 1_764_000_000_123
    assert _value(request_id) & (MAX_SHARDS - 1) == 5


def test_an_id_tells_its_time_and_shard() -> None:
    for shard in (0, 1, 31, 32, MAX_SHARDS - 1):
        request_id = new_request_id(1_764_000_000.5, shard=shard)
        assert request_id_shard(request_id) == shard
        assert request_id_time(request_id) == 1_764_000_000.5


def test_ids_sort_by_creation_time_and_differ() -> None:
    ids = [new_request_id(1_764_000_000 + n / 1000) for n in range(200)]
    assert ids == sorted(ids)
    assert len({new_request_id(1_764_000_000.0) for _ in range(1000)}) == 1000
