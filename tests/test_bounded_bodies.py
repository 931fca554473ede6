"""Bodies one key sends that would make a shared gateway process work out of proportion
to what was sent, against a gateway process of this module's own (its /metrics is the
process that read the body): compressed bodies refused past a decompression ratio and
past a few gzip members or zstd frames, a JSON body past a count of values before it is
parsed, a form past one file or a few fields. While each is sent the process's event loop
is never held over 100 ms and its peak RSS grows by less than 100 MB (tests/bounds.py)."""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator

import httpx
import pytest
import zstandard

from tests.bounds import Watch
from tests.conftest import AUTH

MB = 1 << 20


@pytest.fixture(scope="module")
def lone(stack) -> Iterator[tuple[str, int]]:
    """(url, pid) of a gateway of one process."""
    process, url = stack.start_gateway("gateway-bounded-bodies", GATEWAY_WORKERS="1")
    assert process.pid is not None
    yield url, process.pid
    stack.stop(process)


def _post(url: str, path: str, content: bytes, encoding: str | None = None) -> httpx.Response:
    headers = {**AUTH, "content-type": "application/json"}
    if encoding is not None:
        headers["content-encoding"] = encoding
    return httpx.post(f"{url}{path}", content=content, headers=headers, timeout=120)


def _empty_lists(size: int) -> bytes:
    """A chat call whose messages are `size` bytes of `[],[],…`: ~0.3 µs of json.loads each."""
    head, tail = b'{"model": "llm_echo", "max_tokens": 8, "messages": [', b"[]]}"
    return head + b"[]," * ((size - len(head) - len(tail)) // 3) + tail


def test_a_zstd_body_past_the_ratio_is_413_before_it_is_parsed(lone) -> None:
    url, pid = lone
    body = zstandard.ZstdCompressor(level=19).compress(_empty_lists(8 * MB))
    assert len(body) < 2048  # the 744 bytes
    with Watch(url, pid) as seen:
        response = _post(url, "/v1/chat/completions", body, "zstd")
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "compression_ratio_too_high"
    assert seen.pauses == 0 and seen.grown < 100 * MB, seen


def _empty_frames(encoding: str, count: int) -> bytes:
    return (gzip.compress(b"") if encoding == "gzip" else zstandard.ZstdCompressor().compress(b"")) * count


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_body_of_many_empty_frames_is_400_at_once(lone, encoding: str) -> None:
    url, pid = lone
    body = _empty_frames(encoding, 100_000)  # 2 MB (gzip) and 0.9 MB (zstd) that decode to nothing
    with Watch(url, pid) as seen:
        response = _post(url, "/infer", body, encoding)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "too_many_compressed_frames"
    assert seen.pauses == 0 and seen.grown < 100 * MB, seen


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_few_frames_are_one_body(lone, encoding: str) -> None:
    """The neighbour of the frame cap: four members or frames (a client compressing as it
    streams) are still read as one body."""
    url, _ = lone
    raw = json.dumps({"model": "llm_echo", "inputs": {"text_input": "four frames", "max_tokens": 8}}).encode()
    compress = gzip.compress if encoding == "gzip" else zstandard.ZstdCompressor().compress
    quarter = len(raw) // 4
    parts = [raw[:quarter], raw[quarter : 2 * quarter], raw[2 * quarter : 3 * quarter], raw[3 * quarter :]]
    response = httpx.post(
        f"{url}/infer",
        content=b"".join(compress(part) for part in parts),
        headers={**AUTH, "content-type": "application/json", "content-encoding": encoding, "Prefer": "wait=60"},
        timeout=120,
    )
    assert response.status_code == 200, response.text


def test_a_compressed_body_at_a_low_ratio_is_decoded_off_the_loop_up_to_the_limit(lone) -> None:
    """7 MB of gzip at ~1.3x (hex text): decoded in a worker thread chunk by chunk to past
    the 8 MiB limit, 413 payload_too_large, the loop never held."""
    url, pid = lone
    text = os.urandom(9 * MB // 2).hex()  # 9 MiB of hex digits
    body = gzip.compress(json.dumps({"model": "text_embed", "inputs": {"text": text}}).encode(), 1)
    assert len(body) < 8 * MB
    with Watch(url, pid) as seen:
        response = _post(url, "/infer", body, "gzip")
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"
    assert seen.pauses == 0 and seen.grown < 100 * MB, seen


def test_a_json_body_of_too_many_values_is_413_before_it_is_parsed(lone) -> None:
    """The same `[],[],…` sent as it is: 4 MB is ~1.4 M lists, a second or more of the loop."""
    url, pid = lone
    with Watch(url, pid) as seen:
        response = _post(url, "/v1/chat/completions", _empty_lists(4 * MB))
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "too_many_json_values"
    assert seen.pauses == 0 and seen.grown < 100 * MB, seen


def test_a_json_body_of_many_values_under_the_cap_is_parsed(lone) -> None:
    """The neighbour: 90,000 empty lists (180,000 brackets and commas, under the cap of
    200,000) are parsed and refused as what they are (messages that are not messages), not
    as too many values, without holding the loop."""
    url, pid = lone
    with Watch(url, pid) as seen:
        response = _post(url, "/v1/chat/completions", _empty_lists(270_000))
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] != "too_many_json_values"
    assert seen.pauses == 0, seen


def _multipart(files: int, fields: int) -> tuple[bytes, str]:
    boundary = "b0undary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode(),
        *(f'--{boundary}\r\nContent-Disposition: form-data; name="f{i}"\r\n\r\nx\r\n'.encode() for i in range(fields)),
        *(
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="f{i}.jsonl"\r\n'
            f"Content-Type: application/jsonl\r\n\r\n{{}}\n\r\n".encode()
            for i in range(files)
        ),
        f"--{boundary}--\r\n".encode(),
    ]
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


@pytest.mark.parametrize(("files", "fields"), [(2, 0), (1, 40)])
def test_a_form_past_one_file_or_a_few_fields_is_400(lone, files: int, fields: int) -> None:
    url, _ = lone
    body, content_type = _multipart(files, fields)
    response = httpx.post(f"{url}/v1/files", content=body, headers={**AUTH, "content-type": content_type}, timeout=60)
    assert response.status_code == 400, response.text
    assert "Maximum number of" in response.json()["error"]["message"]
