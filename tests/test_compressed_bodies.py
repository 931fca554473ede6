"""Request bodies sent compressed (Content-Encoding gzip or zstd) against the real stack,
with httpx sending the compressed bytes and the header: read decompressed by the hot
routes and FastAPI's alike (the official `openai` and `anthropic` clients' calls too), the
body limit applied to the decompressed size (a zip bomb is 413 without the gateway ever
holding what it expands to), an unknown encoding 415, a corrupt or cut body 400, and the
key still checked first."""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path

import anthropic
import httpx
import httpx2
import psutil
import pytest
import zstandard

from tests.conftest import AUTH

ECHO = {"model": "llm_echo", "inputs": {"text_input": "hello compressed", "max_tokens": 8}}
LIMIT = 8 * 1024 * 1024  # the stack's MAX_BODY_BYTES (its default)


def _gzip(data: bytes) -> bytes:
    return gzip.compress(data)


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor().compress(data)


COMPRESS = {"gzip": _gzip, "x-gzip": _gzip, "zstd": _zstd}


def _post(stack, path: str, content: bytes, encoding: str | None, **headers: str) -> httpx.Response:
    sent = {**AUTH, "content-type": "application/json", "Prefer": "wait=30", **headers}
    if encoding is not None:
        sent["content-encoding"] = encoding
    return httpx.post(f"{stack.gateway_url}{path}", content=content, headers=sent, timeout=60)


@pytest.mark.parametrize("encoding", sorted(COMPRESS))
def test_a_compressed_body_is_read_decompressed_by_the_hot_route(stack, encoding: str) -> None:
    response = _post(stack, "/infer", COMPRESS[encoding](json.dumps(ECHO).encode()), encoding)
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "succeeded"


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_compressed_body_is_read_decompressed_by_a_fastapi_route(stack, encoding: str) -> None:
    body = {"model": "llm_echo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    response = _post(stack, "/v1/chat/completions", COMPRESS[encoding](json.dumps(body).encode()), encoding)
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


def test_a_body_of_several_gzip_members_is_one_body(stack) -> None:
    raw = json.dumps(ECHO).encode()
    response = _post(stack, "/infer", _gzip(raw[:10]) + _gzip(raw[10:]), "gzip")
    assert response.status_code == 200, response.text


class ZstdTransport(httpx2.HTTPTransport):
    """Sends every request body compressed with zstd, as a client configured to would (the
    `anthropic` package's HTTP client is httpx2's)."""

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        body = _zstd(request.read())
        request.headers["content-encoding"] = "zstd"
        request.headers["content-length"] = str(len(body))
        request.stream = httpx2.ByteStream(body)
        return super().handle_request(request)


def test_the_anthropic_client_with_a_zstd_body_gets_its_message(stack) -> None:
    """The official client, unmodified, given an httpx client that compresses what it sends."""
    with anthropic.DefaultHttpxClient(transport=ZstdTransport(), timeout=60) as http:
        client = anthropic.Anthropic(base_url=stack.gateway_url, api_key=stack.api_key, http_client=http, max_retries=0)
        message = client.messages.create(
            model="llm_echo", messages=[{"role": "user", "content": "zstd"}], max_tokens=100
        )
    assert message.stop_reason == "end_turn" and "zstd" in message.content[0].text


def test_a_body_over_the_limit_once_decompressed_is_413(stack) -> None:
    # Hex digits: ~2x, under the ratio cap (a body past it is 413 compression_ratio_too_high).
    huge = json.dumps({"model": "text_embed", "inputs": {"text": os.urandom(LIMIT // 2 + 1024).hex()}}).encode()
    for encoding in ("gzip", "zstd"):
        compressed = COMPRESS[encoding](huge)
        assert len(compressed) < LIMIT  # under the limit as sent
        response = _post(stack, "/infer", compressed, encoding)
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "payload_too_large"
        assert "decompressed" in response.json()["error"]["message"]


def _gateway_processes(stack) -> list[psutil.Process]:
    found = []
    for managed in stack.launcher.processes:
        if managed.spec.name.startswith("gateway") and managed.pid is not None:
            parent = psutil.Process(managed.pid)
            found += [parent, *parent.children(recursive=True)]
    assert found
    return found


def _peak_rss(process: psutil.Process) -> int:
    """The process's peak resident memory (VmHWM), in bytes."""
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def _bomb(encoding: str, size: int) -> bytes:
    """`size` zero bytes compressed as one gzip member or zstd frame, never held whole here
    either."""
    zeros = bytes(1 << 20)
    if encoding == "gzip":
        gz = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
        return b"".join(gz.compress(zeros) for _ in range(size >> 20)) + gz.flush()
    zst = zstandard.ZstdCompressor(level=3).compressobj(size=size)
    return b"".join(zst.compress(zeros) for _ in range(size >> 20)) + zst.flush()


def test_a_zip_bomb_is_413_without_the_gateway_holding_what_it_expands_to(stack) -> None:
    gigabyte = 1 << 30
    bombs = {encoding: _bomb(encoding, gigabyte) for encoding in ("gzip", "zstd")}
    processes = _gateway_processes(stack)
    before = {p.pid: _peak_rss(p) for p in processes}
    for encoding, bomb in bombs.items():
        assert len(bomb) < 2 << 20  # ~1 MB (gzip) and ~32 KB (zstd) for a gigabyte
        # (Refused past the ratio cap, after ~1 MiB decompressed.)
        for path in ("/infer", "/v1/chat/completions", "/v1/messages"):
            response = _post(stack, path, bomb, encoding)
            assert response.status_code == 413, (encoding, path, response.text)
    grown = max(_peak_rss(p) - before[p.pid] for p in processes)
    assert grown < 256 << 20, f"a gateway process's peak memory grew by {grown >> 20} MiB"


def test_a_413_under_the_messages_api_is_anthropics_request_too_large(stack) -> None:
    bomb = zstandard.ZstdCompressor().compress(bytes(LIMIT + 1))
    response = _post(stack, "/v1/messages", bomb, "zstd")
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "request_too_large"


@pytest.mark.parametrize("encoding", ["br", "deflate", "compress", "gzip, zstd"])
def test_an_encoding_not_served_is_415(stack, encoding: str) -> None:
    response = _post(stack, "/infer", json.dumps(ECHO).encode(), encoding)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_content_encoding"


def test_identity_is_the_body_as_it_is(stack) -> None:
    response = _post(stack, "/infer", json.dumps(ECHO).encode(), "identity")
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("encoding", ["gzip", "zstd"])
def test_a_cut_or_corrupt_compressed_body_is_400(stack, encoding: str) -> None:
    whole = COMPRESS[encoding](json.dumps(ECHO).encode())
    for broken in (whole[: len(whole) // 2], b"not compressed at all"):
        response = _post(stack, "/infer", broken, encoding)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["code"] == "invalid_content_encoding"


def test_the_key_is_checked_before_the_encoding(stack) -> None:
    response = httpx.post(
        f"{stack.gateway_url}/infer",
        content=b"whatever",
        headers={"content-encoding": "br", "content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 401
