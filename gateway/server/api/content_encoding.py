"""Request bodies sent compressed (`Content-Encoding: gzip` or `zstd`), decompressed as
they arrive with a bound: the body limit applies to what they decompress to, and no
call to a decompressor may produce much more than what is left of it, so a small body
that expands to gigabytes (a zip bomb) is refused with 413 after at most the limit (and
one step) has been decompressed, never allocated whole. The edge (gateway.server.api.edge)
also caps the ratio of decompressed to received bytes (the `room` it passes), and hands a
large chunk to a worker thread (`decode`): both libraries release the GIL while they work.

- gzip: zlib's streaming decompressor asked for at most what the limit leaves (exact);
  several gzip members one after another are one body (RFC 1952), up to `max_frames`.
- zstd: `zstandard`'s streaming decompressor (it has no output bound), fed slices small
  enough that they cannot make more than what the limit leaves plus two blocks: a zstd
  block decompresses to at most 128 KiB and takes at least 4 bytes (its 3-byte header
  and one byte), so a slice of n bytes completes at most n/4 + 1 blocks. Windows over
  8 MiB are refused (RFC 9659: a zstd coding of HTTP content uses at most 8 MiB), so a
  frame cannot make the decoder allocate more. Frames (skippable ones too) up to `max_frames`.
- Members and frames are counted because an empty one is 20 (gzip) or 9 (zstd) bytes that
  decode to nothing: without a cap a body of a million of them costs a decompressor each
  while the size limit never trips. 400 `too_many_compressed_frames` past the cap.
- What follows the end of a member or frame is read from the chunk in place (an offset
  into it), never copied again: a chunk of many frames costs linear time, not quadratic.
- A body that ends inside a compressed stream, or holds what is not one, is 400
  `invalid_content_encoding`; an encoding other than these (and `identity`) is 415."""

from __future__ import annotations

import asyncio
import zlib
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import zstandard

from gateway.server.api.errors import BodyRefused

ENCODINGS = ("gzip", "zstd")
# A zstd block's most decompressed bytes, and its fewest compressed bytes (header + one).
_ZSTD_BLOCK_MAX = 128 * 1024
_ZSTD_BLOCK_MIN = 4
ZSTD_MAX_WINDOW = 8 * 1024 * 1024
# Real clients send one member or frame (a few when they compress as they stream).
DEFAULT_MAX_FRAMES = 4
# A chunk at least this long is decoded in a worker thread: a small body (the usual
# compressed JSON call) is decoded inline, sparing the thread hop.
OFF_LOOP_CHUNK = 16 * 1024
# Two threads: decoding is bounded a chunk, so a few bodies at once only wait their turn;
# a pool of its own, so they never wait behind the loop's default executor (or it behind them).
_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="body-decode")


class Decoder(Protocol):
    def feed(self, chunk: bytes, room: int) -> bytes:
        """What `chunk` decompresses to; more than `room` bytes only by a bounded step
        (the caller refuses the body then)."""

    def finish(self) -> None:
        """The body ended: refuse it if it ended inside a compressed stream."""


async def decode(decoder: Decoder, chunk: bytes, room: int) -> bytes:
    """`decoder.feed(chunk, room)`, in a worker thread when the chunk is large."""
    if len(chunk) < OFF_LOOP_CHUNK:
        return decoder.feed(chunk, room)
    return await asyncio.get_running_loop().run_in_executor(_POOL, decoder.feed, chunk, room)


def _corrupt(encoding: str, why: object) -> BodyRefused:
    return BodyRefused(400, "invalid_content_encoding", f"the body is not valid {encoding} data: {why}")


def _too_many(what: str, limit: int) -> BodyRefused:
    return BodyRefused(400, "too_many_compressed_frames", f"the body holds more than {limit} {what}: send it as one")


class GzipDecoder:
    def __init__(self, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
        self._fed = False
        self._members = 1
        self._max = max_frames

    def feed(self, chunk: bytes, room: int) -> bytes:
        out: list[bytes] = []
        view = memoryview(chunk)
        at = 0
        try:
            while at < len(view):
                self._fed = True
                if self._d.eof:  # a new member begins
                    self._members += 1
                    if self._members > self._max:
                        raise _too_many("gzip members", self._max)
                    self._d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
                rest = view[at:]
                piece = self._d.decompress(rest, max(room, 0) + 1)
                out.append(piece)
                room -= len(piece)
                if room < 0:
                    break  # over the limit: the caller refuses the body
                # What it left: input kept for want of output room, or what follows the member.
                at += len(rest) - len(self._d.unconsumed_tail) - len(self._d.unused_data)
                if self._d.unconsumed_tail and not self._d.eof:
                    continue
                if not self._d.eof:
                    break  # all of it consumed, the member goes on in the next chunk
        except zlib.error as exc:
            raise _corrupt("gzip", exc) from None
        return b"".join(out)

    def finish(self) -> None:
        if self._fed and not self._d.eof:
            raise _corrupt("gzip", "it ends before its stream does")


class ZstdDecoder:
    def __init__(self, max_frames: int = DEFAULT_MAX_FRAMES) -> None:
        self._z = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        self._d = self._z.decompressobj()
        self._between = True  # between frames (none begun, or the last one ended)
        self._frames = 0
        self._max = max_frames

    def feed(self, chunk: bytes, room: int) -> bytes:
        out: list[bytes] = []
        view = memoryview(chunk)
        at = 0
        try:
            while at < len(view):
                if self._between:  # a frame begins
                    self._frames += 1
                    if self._frames > self._max:
                        raise _too_many("zstd frames", self._max)
                # At most room + 2 blocks out of this slice (the module's docstring).
                size = _ZSTD_BLOCK_MIN * (max(room, 0) // _ZSTD_BLOCK_MAX + 1)
                part = view[at : at + size]
                piece = self._d.decompress(part)
                self._between = self._d.eof
                if self._d.eof:  # a frame ended: what followed it in the slice begins the next
                    at += len(part) - len(self._d.unused_data)
                    self._d = self._z.decompressobj()
                else:
                    at += len(part)
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


def decoder_for(header: bytes | None, max_frames: int = DEFAULT_MAX_FRAMES) -> Decoder | None:
    """The decoder a Content-Encoding asks for (None: the body is sent as it is); 415 for
    an encoding not served, several encodings included."""
    if header is None:
        return None
    name = header.decode("latin-1").strip().lower()
    if name in ("", "identity"):
        return None
    if name in ("gzip", "x-gzip"):
        return GzipDecoder(max_frames)
    if name == "zstd":
        return ZstdDecoder(max_frames)
    raise BodyRefused(
        415,
        "unsupported_content_encoding",
        f"Content-Encoding {name!r} is not supported: send the body as it is, or with one of gzip, zstd",
    )
