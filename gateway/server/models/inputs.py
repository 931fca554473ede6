"""Request inputs and parameters per model kind, validated before anything is queued.
Every string and list has a limit."""

from __future__ import annotations

import base64
import binascii
import re
import struct
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, StringConstraints, model_validator

from gateway.server.models.base import InvalidInput

MAX_TEXT_CHARS = 100_000
MAX_IMAGE_BASE64 = 11 * 1024 * 1024
# Pixels an image may declare (width x height; MAX_IMAGE_PIXELS, set by the app from its
# settings): a few MB of JPEG can declare 40000x40000, which a decoder allocates in full
# (nvjpeg on the GPU has no limit of its own).
DEFAULT_MAX_IMAGE_PIXELS = 50_000_000
_max_image_pixels = DEFAULT_MAX_IMAGE_PIXELS
# A stop or bad word: short text, as TensorRT-LLM's word lists expect.
Word = Annotated[str, StringConstraints(min_length=1, max_length=256)]
# What image files begin with: PNG, JPEG, GIF, WebP (RIFF), BMP.
_IMAGE_SIGNATURES = (b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF87a", b"GIF89a", b"RIFF", b"BM")


class Strict(BaseModel):
    """Model inputs: unknown fields refused, and no coercion (a "8" is not a number, a
    true is not 1)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class LlmInputs(Strict):
    text_input: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["Hello, my name is"])
    max_tokens: int = Field(default=64, ge=1, le=4096)
    stop_words: list[Word] = Field(default_factory=list, max_length=16)
    bad_words: list[Word] = Field(default_factory=list, max_length=64)


class LlmParameters(Strict):
    temperature: float | None = Field(default=None, ge=0, le=10)
    top_k: int | None = Field(default=None, ge=0, le=1000)
    top_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)

    @property
    def greedy(self) -> bool:
        """TensorRT-LLM's rule (both contracts): temperature 0, or no top_k above 1 and no
        top_p, is greedy search; anything else samples."""
        return self.temperature == 0 or ((self.top_k or 0) <= 1 and not self.top_p)

    @property
    def unseeded(self) -> bool:
        """Samples without a seed: the engines' default seed would draw the same every time."""
        return self.seed is None and not self.greedy


class EngineParameters(LlmParameters):
    """The parameters of an LLM on its engine or the llmapi contract (the ensemble takes only
    LlmParameters: what it cannot pass on is refused, never dropped)."""

    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    # The log-probability of each generated token (outputs.logprobs), with this many of the
    # most likely alternatives at each position (engine contract only).
    logprobs: bool = False
    top_logprobs: int = Field(default=0, ge=0, le=20)
    # Requests with the same key prefer the same replica (routing affinity, per model).
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    # The prefix cache's salt: set by the gateway to the tenant (a caller's own is refused),
    # so that no tenant can learn from cache hits what another tenant sent.
    cache_salt: str | None = Field(default=None, max_length=256)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> EngineParameters:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TextInputs(Strict):
    text: str = Field(min_length=1, max_length=MAX_TEXT_CHARS, examples=["a cat sits on the mat"])


class ImageInputs(Strict):
    image: str = Field(max_length=MAX_IMAGE_BASE64, description="PNG or JPEG file, base64-encoded")
    _data: bytes = PrivateAttr(default=b"")

    @model_validator(mode="after")
    def _decode(self) -> ImageInputs:
        self._data = decode_image(self.image)  # once: the tensor and the digest reuse it
        refuse_huge_image(self._data)
        return self

    @property
    def data(self) -> bytes:
        return self._data


class NoParameters(Strict):
    pass


def decode_image(value: str) -> bytes:
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError("image is not valid base64") from None
    if not data.startswith(_IMAGE_SIGNATURES):
        raise ValueError("image is not a PNG, JPEG, GIF, WebP or BMP file")
    return data


def limit_image_pixels(pixels: int) -> None:
    """The most pixels an image may declare (the gateway's MAX_IMAGE_PIXELS)."""
    global _max_image_pixels
    _max_image_pixels = pixels


def refuse_huge_image(data: bytes) -> None:
    """InvalidInput image_too_large when the image's header declares more pixels than the
    limit: read from the header alone, nothing decoded. (An InvalidInput, not a ValueError:
    pydantic passes it on as it is, so its code reaches the caller.) A header that cannot be
    read is unreadable_image, and a JPEG that declares two frames (two sizes: this reads
    one, a decoder may take another) ambiguous_image: neither reaches a model, whose
    decoder would be the first to read its size."""
    try:
        size = image_size(data)
    except AmbiguousImage as exc:
        raise InvalidInput("ambiguous_image", str(exc)) from None
    if size is None:
        raise InvalidInput("unreadable_image", "the image's header cannot be read (its size is not where it should be)")
    if size[0] * size[1] > _max_image_pixels:
        width, height = size
        raise InvalidInput(
            "image_too_large",
            f"the image is {width}x{height} pixels ({width * height}); at most {_max_image_pixels} pixels are taken",
            {"width": width, "height": height, "max_pixels": _max_image_pixels},
        )


class AmbiguousImage(ValueError):
    """The header declares the image's size more than once."""


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) as a PNG, JPEG, GIF, WebP or BMP header declares it; None when the
    header cannot be read; AmbiguousImage for a JPEG with more than one frame header. In
    bounded time: a few hundred steps at most, whatever the file holds."""
    try:
        if data.startswith(b"\x89PNG\r\n\x1a\n"):
            return _png_size(data)
        if data.startswith(b"\xff\xd8"):
            return _jpeg_size(data)
        if data.startswith((b"GIF87a", b"GIF89a")):
            return _gif_size(data)
        if data.startswith(b"RIFF") and data[8:12] == b"WEBP":
            return _webp_size(data)
        if data.startswith(b"BM"):
            return _bmp_size(data)
    except (struct.error, IndexError):
        return None
    return None


def _png_size(data: bytes) -> tuple[int, int] | None:
    # The first chunk is IHDR: length, type, then width and height (big-endian).
    if data[12:16] != b"IHDR":
        return None
    width, height = struct.unpack_from(">II", data, 16)
    return width, height


# JPEG markers without a length (TEM, RST0-7, SOI, EOI) and the start-of-frame markers
# (SOF0-15 but DHT, JPG and DAC), whose segment holds the height and width.
_JPEG_STANDALONE = frozenset({0x01, *range(0xD0, 0xDA)})
_JPEG_FRAME = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


# Segments before the first scan: a real JPEG has a few dozen (APP, DQT, DHT, SOF, COM; a
# large ICC profile up to 255 APP2 chunks). More is refused as unreadable, so a file of
# tiny segments costs at most this many steps.
_JPEG_MAX_SEGMENTS = 512
_FILL = re.compile(rb"\xff*")


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    """The frame header's size, read through every segment up to the first scan (a decoder
    such as PIL's takes the last frame header it meets there: two are refused)."""
    size: tuple[int, int] | None = None
    at = 2
    for _ in range(_JPEG_MAX_SEGMENTS):
        if at + 4 > len(data) or data[at] != 0xFF:
            return None
        # Fill bytes (any number of 0xFF) before the marker: skipped at once, not a step each.
        fill = _FILL.match(data, at + 1)
        at = (fill.end() if fill is not None else at + 1) - 1
        marker = data[at + 1]
        if marker in _JPEG_STANDALONE:
            at += 2
            continue
        if marker == 0xDA:  # start of scan: the frame header, if any, came before it
            return size
        if marker in _JPEG_FRAME:
            if size is not None:
                raise AmbiguousImage("the JPEG declares more than one frame (two sizes): send it re-encoded")
            height, width = struct.unpack_from(">HH", data, at + 5)
            size = width, height
        (length,) = struct.unpack_from(">H", data, at + 2)
        if length < 2:
            return None
        at += 2 + length
    return None


# Extension sub-blocks read before the first frame (a large XMP packet is a few thousand
# of 255 bytes); more is refused as unreadable, so a file of one-byte sub-blocks is not a
# step each.
_GIF_MAX_BLOCKS = 16384


def _gif_size(data: bytes) -> tuple[int, int] | None:
    """The logical screen, grown to the first frame's extent (a decoder allocates both)."""
    width, height, flags = struct.unpack_from("<HHB", data, 6)
    at = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    steps = 0
    while at < len(data):
        block = data[at]
        if block == 0x2C:  # image descriptor: left, top, width, height
            left, top, frame_w, frame_h = struct.unpack_from("<HHHH", data, at + 1)
            return max(width, left + frame_w), max(height, top + frame_h)
        if block != 0x21:  # the trailer, or not a block at all
            break
        at += 2  # an extension: introducer, label, then sub-blocks up to an empty one
        while data[at]:
            at += data[at] + 1
            steps += 1
            if steps > _GIF_MAX_BLOCKS:
                return None
        at += 1
    return width, height


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8X":  # canvas width - 1 and height - 1, 24 bits each
        return 1 + int.from_bytes(data[24:27], "little"), 1 + int.from_bytes(data[27:30], "little")
    if chunk == b"VP8 " and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack_from("<HH", data, 26)
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and data[20] == 0x2F:  # 14 bits of width - 1, then of height - 1
        (bits,) = struct.unpack_from("<I", data, 21)
        return 1 + (bits & 0x3FFF), 1 + ((bits >> 14) & 0x3FFF)
    return None


def _bmp_size(data: bytes) -> tuple[int, int]:
    (header,) = struct.unpack_from("<I", data, 14)
    if header == 12:  # OS/2's BITMAPCOREHEADER: 16-bit sides
        width, height = struct.unpack_from("<HH", data, 18)
        return width, height
    width, height = struct.unpack_from("<ii", data, 18)
    return abs(width), abs(height)  # a negative height: rows top-down
