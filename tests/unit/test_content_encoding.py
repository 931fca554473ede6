"""The bounded decompression of request bodies (gateway.server.api.content_encoding), fed
as the edge feeds it: chunk by chunk, with what the body limit leaves."""

from __future__ import annotations

import gzip
import json
import tracemalloc
import zlib

import pytest
import zstandard

from gateway.server.api.content_encoding import ZSTD_MAX_WINDOW, decoder_for
from gateway.server.api.errors import BodyRefused

PAYLOAD = json.dumps({"text": "abc " * 50_000}).encode()
COMPRESS = {"gzip": gzip.compress, "zstd": lambda data: zstandard.ZstdCompressor().compress(data)}


def _read(encoding: str, data: bytes, limit: int, chunk: int = 65536) -> bytes | None:
    """The body decompressed, or None where it went over the limit (the edge's 413)."""
    decoder = decoder_for(encoding.encode())
    assert decoder is not None
    parts, total = [], 0
    for at in range(0, len(data), chunk):
        out = decoder.feed(data[at : at + chunk], limit - total)
        total += len(out)
        if total > limit:
            return None
        parts.append(out)
    decoder.finish()
    return b"".join(parts)


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
@pytest.mark.parametrize("chunk", [1, 7, 65536])
def test_a_body_decompresses_whole_whatever_its_chunks(encoding: str, chunk: int) -> None:
    compressed = COMPRESS[encoding](PAYLOAD)
    assert _read(encoding, compressed, 1 << 20, chunk) == PAYLOAD


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_members_or_frames_one_after_another_are_one_body(encoding: str) -> None:
    compress = COMPRESS[encoding]
    assert _read(encoding, compress(PAYLOAD[:1000]) + compress(PAYLOAD[1000:]), 1 << 20) == PAYLOAD


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_a_body_over_the_limit_decompressed_is_refused_at_the_limit(encoding: str) -> None:
    assert _read(encoding, COMPRESS[encoding](PAYLOAD), len(PAYLOAD) - 1) is None
    assert _read(encoding, COMPRESS[encoding](PAYLOAD), len(PAYLOAD)) == PAYLOAD


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_a_bomb_is_refused_holding_little_more_than_the_limit(encoding: str) -> None:
    zeros, size, limit = bytes(1 << 20), 512 << 20, 4 << 20
    if encoding == "gzip":  # one stream (level 1: quick to make)
        gz = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        bomb = b"".join(gz.compress(zeros) for _ in range(size >> 20)) + gz.flush()
    else:
        zst = zstandard.ZstdCompressor().compressobj(size=size)
        bomb = b"".join(zst.compress(zeros) for _ in range(size >> 20)) + zst.flush()
    tracemalloc.start()
    try:
        assert _read(encoding, bomb, limit) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * limit  # the parts kept and one step past the limit, not 512 MiB


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_a_cut_body_is_400(encoding: str) -> None:
    compressed = COMPRESS[encoding](PAYLOAD)
    with pytest.raises(BodyRefused) as refused:
        _read(encoding, compressed[: len(compressed) // 2], 1 << 20)
    assert (refused.value.status, refused.value.code) == (400, "invalid_content_encoding")


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_a_body_that_is_not_compressed_is_400(encoding: str) -> None:
    with pytest.raises(BodyRefused) as refused:
        _read(encoding, b'{"plain": "json"}', 1 << 20)
    assert refused.value.code == "invalid_content_encoding"


def test_a_zstd_window_over_8_mib_is_refused() -> None:
    params = zstandard.ZstdCompressionParameters.from_level(19, window_log=24)
    compressor = zstandard.ZstdCompressor(compression_params=params).compressobj()  # (size unknown: window kept)
    wide = compressor.compress(PAYLOAD) + compressor.flush()
    assert zstandard.get_frame_parameters(wide).window_size > ZSTD_MAX_WINDOW
    with pytest.raises(BodyRefused) as refused:
        _read("zstd", wide, 1 << 20)
    assert refused.value.code == "invalid_content_encoding"


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_an_empty_body_is_empty(encoding: str) -> None:
    assert _read(encoding, b"", 10) == b""


@pytest.mark.parametrize("header", [None, b"identity", b"IDENTITY", b""])
def test_no_encoding_or_identity_reads_the_body_as_it_is(header: bytes | None) -> None:
    assert decoder_for(header) is None


@pytest.mark.parametrize("header", [b"br", b"deflate", b"compress", b"gzip, zstd", b"zstd;q=1"])
def test_an_encoding_not_served_is_415(header: bytes) -> None:
    with pytest.raises(BodyRefused) as refused:
        decoder_for(header)
    assert (refused.value.status, refused.value.code) == (415, "unsupported_content_encoding")
