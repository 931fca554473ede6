"""Image headers read in bounded time and refused when they cannot be read or say two
things, against a gateway process of this module's own (its /metrics is the process that
read the image): a JPEG of megabytes of fill bytes before its markers does not hold the
event loop (POST /infer, and POST /search, whose validation runs in a worker thread), an
unreadable header is 422 unreadable_image instead of a run the model fails, and a JPEG with
two frame headers (this reads one, PIL the last) is 422 ambiguous_image."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import pytest

from gateway.server.models.inputs import image_size
from tests.bounds import Watch
from tests.conftest import AUTH

MB = 1 << 20


@pytest.fixture(scope="module")
def lone(stack) -> Iterator[tuple[str, int]]:
    """(url, pid) of a gateway of one process."""
    process, url = stack.start_gateway("gateway-image-headers", GATEWAY_WORKERS="1")
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


def _jpeg(size: tuple[int, int] = (16, 16)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(out, format="JPEG")
    return out.getvalue()


def _filled_jpeg(fill: int) -> bytes:
    """A real JPEG with `fill` 0xFF fill bytes before each marker after SOI's (allowed:
    ITU T.81 B.1.1.2), a byte-at-a-time scan's worst case."""
    data = _jpeg()
    return data[:2] + b"\xff" * fill + data[2:]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_a_jpeg_of_megabytes_of_fill_bytes_is_read_without_holding_the_loop(lone) -> None:
    url, pid = lone
    image = _filled_jpeg(5 * MB)  # 7 MB of base64: under the body limit
    assert image_size(image) == (16, 16)
    with Watch(url, pid) as seen:
        response = httpx.post(
            f"{url}/infer", json={"model": "clip_image", "inputs": {"image": _b64(image)}}, headers=AUTH, timeout=120
        )
    assert response.status_code == 202, response.text
    assert seen.pauses == 0 and seen.grown < 100 * 1024 * 1024, seen


def test_a_search_by_a_jpeg_of_fill_bytes_does_not_hold_the_loop(lone) -> None:
    url, pid = lone
    with Watch(url, pid) as seen:
        response = httpx.post(
            f"{url}/search", json={"image": _b64(_filled_jpeg(5 * MB)), "k": 1}, headers=AUTH, timeout=120
        )
    assert response.status_code in (200, 422), response.text  # searched, or the model's own refusal
    assert seen.pauses == 0, seen


def test_an_unreadable_image_header_is_422_unreadable_image(lone) -> None:
    url, _ = lone
    broken = b"\x89PNG\r\n\x1a\n" + b"\x00" * 64  # a PNG signature, no IHDR
    response = httpx.post(
        f"{url}/infer", json={"model": "clip_image", "inputs": {"image": _b64(broken)}}, headers=AUTH, timeout=60
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "unreadable_image"


def _two_frames() -> bytes:
    """A real 16x16 JPEG with a second frame header, declaring 4000x4000, before its scan:
    PIL takes the last one it meets."""
    data = _jpeg()
    sos = data.index(b"\xff\xda")
    sof = data.index(b"\xff\xc0")
    length = int.from_bytes(data[sof + 2 : sof + 4], "big")
    second = bytearray(data[sof : sof + 2 + length])
    second[5:9] = (4000).to_bytes(2, "big") * 2
    return data[:sos] + bytes(second) + data[sos:]


def test_a_jpeg_with_two_frame_headers_is_422_ambiguous_image(lone) -> None:
    from PIL import Image

    image = _two_frames()
    assert Image.open(io.BytesIO(image)).size == (4000, 4000)  # what a decoder would allocate
    url, _ = lone
    response = httpx.post(
        f"{url}/infer", json={"model": "clip_image", "inputs": {"image": _b64(image)}}, headers=AUTH, timeout=60
    )
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "ambiguous_image"


def test_a_jpeg_with_one_frame_header_and_many_segments_is_served(lone) -> None:
    """The neighbour: a JPEG with a hundred comment segments before its frame is still read."""
    data = _jpeg()
    comments = b"".join(b"\xff\xfe\x00\x07hello" for _ in range(100))
    image = data[:2] + comments + data[2:]
    assert image_size(image) == (16, 16)
    url, _ = lone
    response = httpx.post(
        f"{url}/infer",
        json={"model": "clip_image", "inputs": {"image": _b64(image)}},
        headers={**AUTH, "Prefer": "wait=60"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded"
