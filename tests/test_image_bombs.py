"""Image decompression bombs: an image whose header declares more pixels than
MAX_IMAGE_PIXELS is refused from its header, before anything decodes it: by the gateway
(422 image_too_large, naming the limit) and by the models' image steps (their own limit,
before PIL or nvjpeg allocate). The first tests need no server; the last one goes to the
real gateway of the session's stack."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator

import httpx
import pytest

from gateway.server.models.base import InvalidInput, check
from gateway.server.models.inputs import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageInputs,
    image_size,
    limit_image_pixels,
    refuse_huge_image,
)
from tests.conftest import AUTH
from tests.production.conftest import load_model_py

HUGE = (40000, 40000)  # 1.6 Gpx: ~4.8 GB as RGB, more as floats on a GPU


def _encoded(fmt: str, size: tuple[int, int], **options: object) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(out, format=fmt, **options)
    return out.getvalue()


def huge_png(width: int, height: int) -> bytes:
    """A PNG header declaring width x height, and no pixels."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))


def huge_jpeg(width: int, height: int) -> bytes:
    """A real small JPEG whose frame header is rewritten to declare width x height."""
    data = bytearray(_encoded("JPEG", (16, 16)))
    at = data.index(b"\xff\xc0")
    data[at + 5 : at + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def huge_gif(width: int, height: int) -> bytes:
    data = bytearray(_encoded("GIF", (16, 16)))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


def huge_webp(width: int, height: int) -> bytes:
    """An extended WebP (VP8X) header: the canvas is what a decoder allocates."""
    canvas = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    chunk = b"VP8X" + struct.pack("<I", 10) + b"\x00\x00\x00\x00" + canvas
    return b"RIFF" + struct.pack("<I", 4 + len(chunk)) + b"WEBP" + chunk


def huge_bmp(width: int, height: int) -> bytes:
    data = bytearray(_encoded("BMP", (16, 16)))
    data[18:26] = struct.pack("<ii", width, -height)  # top-down rows: a negative height
    return bytes(data)


HUGE_IMAGES = {"png": huge_png, "jpeg": huge_jpeg, "gif": huge_gif, "webp": huge_webp, "bmp": huge_bmp}


@pytest.fixture
def pixel_limit() -> Iterator[None]:
    yield
    limit_image_pixels(DEFAULT_MAX_IMAGE_PIXELS)


@pytest.mark.parametrize(
    ("fmt", "options"),
    [
        ("PNG", {}),
        ("JPEG", {}),
        ("JPEG", {"progressive": True}),
        ("JPEG", {"exif": b"Exif\x00\x00" + b"x" * 300}),  # an APP1 segment before the frame
        ("GIF", {}),
        ("WEBP", {}),
        ("WEBP", {"lossless": True}),
        ("BMP", {}),
    ],
)
@pytest.mark.parametrize("size", [(1, 1), (640, 480), (333, 1017)])
def test_the_size_read_from_the_header_is_the_size_pil_decodes(
    fmt: str, options: dict[str, object], size: tuple[int, int]
) -> None:
    from PIL import Image

    data = _encoded(fmt, size, **options)
    assert image_size(data) == Image.open(io.BytesIO(data)).size == size


@pytest.mark.parametrize("fmt", sorted(HUGE_IMAGES))
def test_an_image_declaring_huge_dimensions_is_refused_from_its_header(fmt: str) -> None:
    data = HUGE_IMAGES[fmt](*HUGE)
    assert len(data) < 4096  # a few bytes declare it: nothing of the kind was decoded
    assert image_size(data) == HUGE
    with pytest.raises(InvalidInput) as refused:
        check(ImageInputs, {"image": base64.b64encode(data).decode()}, "clip_image", "invalid_inputs")
    assert refused.value.code == "image_too_large"
    assert "40000x40000" in refused.value.message
    assert str(DEFAULT_MAX_IMAGE_PIXELS) in refused.value.message
    assert refused.value.details == {"width": 40000, "height": 40000, "max_pixels": DEFAULT_MAX_IMAGE_PIXELS}


def test_the_pixel_limit_is_configurable(pixel_limit: None) -> None:
    data = _encoded("PNG", (20, 20))
    refuse_huge_image(data)  # 400 pixels: within the default
    limit_image_pixels(399)
    with pytest.raises(InvalidInput, match="at most 399 pixels"):
        refuse_huge_image(data)
    limit_image_pixels(400)
    refuse_huge_image(data)


def test_an_unreadable_header_is_refused_as_unreadable_image() -> None:
    # (An image whose header reads but whose data does not is the model's to refuse:
    # tests/test_gateway_api.py.)
    for data in (b"\x89PNG\r\n\x1a\n" + b"\x00" * 64, b"\xff\xd8\xff", b"GIF89a", b"BM"):
        assert image_size(data) is None
        with pytest.raises(InvalidInput) as refused:
            refuse_huge_image(data)
        assert refused.value.code == "unreadable_image"


# -- the models' own limit ---------------------------------------------------------------


@pytest.mark.parametrize("size", [HUGE, (8000, 8000)])  # past PIL's own limit, and within it
def test_the_local_image_step_refuses_a_huge_image_before_pil_or_nvjpeg_decode_it(size: tuple[int, int]) -> None:
    step = load_model_py("local", "clip_image_preprocessing")
    transform = step.ClipImageTransform({"size": {"shortest_edge": 224}}, max_pixels=DEFAULT_MAX_IMAGE_PIXELS)
    data = huge_jpeg(*size)
    with pytest.raises(ValueError, match="over the limit of 50000000 pixels"):
        transform(data)
    assert not transform.within_limit(data)  # so the GPU path keeps it from nvjpeg
    assert transform.within_limit(_encoded("JPEG", (64, 48)))
    decoded = step.TorchImageTransform(transform).decode([data, _encoded("PNG", (64, 48))])
    assert isinstance(decoded[0], ValueError)
    assert tuple(decoded[1].shape) == (3, 48, 64)


@pytest.mark.parametrize("size", [HUGE, (8000, 8000)])
def test_the_tensorrt_image_step_refuses_a_huge_image_before_pil_decodes_it(size: tuple[int, int]) -> None:
    step = load_model_py("clip_trt", "clip_trt_image_preprocessing")
    config = step.ImageConfig(224, 224, 224, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), 1 / 255, 3)
    with pytest.raises(ValueError, match="over the limit of 50000000 pixels"):
        step.preprocess_image(huge_jpeg(*size), config)
    assert step.preprocess_image(_encoded("PNG", (300, 240)), config).shape == (3, 224, 224)


# -- the real gateway ---------------------------------------------------------------------


async def test_the_gateway_refuses_a_huge_image_with_422_image_too_large(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30, headers=AUTH) as client:
        for make in (huge_png, huge_jpeg):
            image = base64.b64encode(make(*HUGE)).decode()
            response = await client.post("/infer", json={"model": "clip_image", "inputs": {"image": image}})
            assert response.status_code == 422, response.text
            error = response.json()["error"]
            assert error["code"] == "image_too_large"
            assert str(DEFAULT_MAX_IMAGE_PIXELS) in error["message"]
        # An image of an ordinary size still goes through.
        image = base64.b64encode(_encoded("PNG", (64, 48))).decode()
        response = await client.post("/infer", json={"model": "clip_image", "inputs": {"image": image}})
        assert response.status_code == 202, response.text
