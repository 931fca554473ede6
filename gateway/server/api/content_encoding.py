"""Request bodies sent compressed (`Content-Encoding: gzip` or `zstd`), decompressed as
they arrive with a bound: the body limit applies to what they decompress to, and no
call to a decompressor may produce much more than what is left of it, so a small body
that expands to gigabytes (a zip bomb) is refused with 413 after at most the limit (and
one step) has been decompressed, never allocated whole.

- gzip: zlib's streaming decompressor asked for at most what the limit leaves (exact);
  several gzip members one after another are one body (RFC 1952).
- zstd: `zstandard`'s streaming decompressor (it has no output bound), fed slices small
  enough that they cannot make more than what the limit leaves plus two blocks: a zstd
  block decompresses to at most 128 KiB and takes at least 4 bytes (its 3-byte header
  and one byte), so a slice of n bytes completes at most n/4 + 1 blocks. Windows over
  8 MiB are refused (RFC 9659: a zstd coding of HTTP content uses at most 8 MiB), so a
  frame cannot make the decoder allocate more.
- A body that ends inside a compressed stream, or holds what is not one, is 400
  `invalid_content_encoding`; an encoding other than these (and `identity`) is 415."""

from __future__ import annotations

import zlib
from typing import Protocol

import zstandard

from gateway.server.api.errors import BodyRefused

ENCODINGS = ("gzip", "zstd")
# A zstd block's most decompressed bytes, and its fewest compressed bytes (header + one).
_ZSTD_BLOCK_MAX = 128 * 1024
_ZSTD_BLOCK_MIN = 4
ZSTD_MAX_WINDOW = 8 * 1024 * 1024


class Decoder(Protocol):
    def feed(self, chunk: bytes, room: int) -> bytes:
        """What `chunk` decompresses to; more than `room` bytes only by a bounded step
        (the caller refuses the body then)."""

    def finish(self) -> None:
        """The body ended: refuse it if it ended inside a compressed stream."""


def _corrupt(encoding: str, why: object) -> BodyRefused:
    return BodyRefused(400, "invalid_content_encoding", f"the body is not valid {encoding} data: {why}")


class GzipDecoder:
    def __init__(self) -> None:
        self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        self._fed = False

    def feed(self, chunk: bytes, room: int) -> bytes:
        out: list[bytes] = []
        data = chunk
        try:
            while data:
                self._fed = True
                if self._d.eof:  # a new member begins
                    self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
                piece = self._d.decompress(data, room + 1)
                out.append(piece)
                room -= len(piece)
                if room < 0:
                    break  # over the limit: the caller refuses the body
                data = self._d.unconsumed_tail or self._d.unused_data
        except zlib.error as exc:
            raise _corrupt("gzip", exc) from None
        return b"".join(out)

    def finish(self) -> None:
        if self._fed and not self._d.eof:
            raise _corrupt("gzip", "it ends before its stream does")


class ZstdDecoder:
    def __init__(self) -> None:
        self._z = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._d = self._z.decompressobj()
        self._between = True  # between frames (none begun, or the last one ended)

    def feed(self, chunk: bytes, room: int) -> bytes:
        out: list[bytes] = []
        data = memoryview(chunk)
        try:
            while data:
                # At most room + 2 blocks out of this slice (the module's docstring).
                size = _ZSTD_BLOCK_MIN * (max(room, 0) // _ZSTD_BLOCK_MAX + 1)
                piece = self._d.decompress(data[:size])
                data = data[size:]
                self._between = self._d.eof
                if self._d.eof:  # a frame ended: what followed it in the slice begins the next
                    data = memoryview(self._d.unused_data + data)
                    self._d = self._z.decompressobj()
                out.append(piece)
                room -= len(piece)
                if room < 0:
                    break  # over the limit: the caller refuses the body
        except zstandard.ZstdError as exc:
            raise _corrupt("zstd", exc) from None
        return b"".join(out)

    def finish(self) -> None:
        if not self._between:
            raise _corrupt("zstd", "it ends before its frame does")


def decoder_for(header: bytes | None) -> Decoder | None:
    """The decoder a Content-Encoding asks for (None: the body is sent as it is); 415 for
    an encoding not served, several encodings included."""
    if header is None:
        return None
    name = header.decode("latin-1").strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return GzipDecoder()
    if name == "zstd":
        return ZstdDecoder()
    raise BodyRefused(
        415,
        "unsupported_content_encoding",
        f"Content-Encoding {name!r} is not supported: send the body as it is, or with one of gzip, zstd",
    )
