"""End to end through real nginx (nginx/nginx.conf) in front of two gateway processes
of the local stack: SSE events arrive one by one, requests spread over both, a Responses
WebSocket passes, and an anonymous body is refused by the gateway while it is still
arriving, never spooled to nginx's temp files."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
from datetime import datetime

import httpx
import pytest
import websockets.sync.client as ws_client

from gateway.deploy.nginx import ensure_nginx, write_local_conf
from gateway.stack.process import free_port
from tests.conftest import AUTH
from tests.gateway_calls import llm_body, submit, wait_result


@pytest.fixture(scope="module")
def nginx_in_front(stack, tmp_path_factory):
    gateways = [stack.start_gateway(f"gateway-behind-nginx-{i}") for i in range(2)]
    workdir = tmp_path_factory.mktemp("nginx")
    port = free_port()
    upstreams = [url.removeprefix("http://") for _, url in gateways]
    conf = write_local_conf(workdir, http_port=port, gateways=upstreams)
    nginx = subprocess.Popen(
        [
            str(ensure_nginx()),
            "-p",
            str(workdir),
            "-c",
            str(conf),
            "-e",
            str(workdir / "error.log"),
            "-g",
            "daemon off;",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert nginx.poll() is None and time.monotonic() < deadline, (workdir / "error.log").read_text()
        time.sleep(0.1)
    yield {
        "url": base,
        "port": port,
        "gateways": [url for _, url in gateways],
        "bodies": workdir / "tmp" / "client_body",
    }
    nginx.terminate()  # by its pid
    nginx.wait(10)
    for process, _ in gateways:
        stack.stop(process)


async def test_sse_events_arrive_through_nginx_one_by_one(nginx_in_front) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=nginx_in_front["url"], timeout=60) as client:
        # The synthetic engine makes a token every 20 ms, however busy the machine: 100 take
        # 2 s, so buffered and streamed differ by far more than the load can blur.
        body = {**llm_body("Through nginx", 100, stream=True), "model": "llm_synthetic"}
        request_id = await submit(client, body)
        arrivals: list[tuple[float, str]] = []
        async with client.stream("GET", f"/results/{request_id}/events") as response:
            async for line in response.aiter_lines():
                if line.startswith("event:"):
                    arrivals.append((time.time(), line.split(":", 1)[1].strip()))
                    if arrivals[-1][1] == "completed":
                        break
        record = await wait_result(client, request_id)
    tokens = [at for at, kind in arrivals if kind == "token"]
    finished = datetime.fromisoformat(record["finished_at"]).timestamp()
    # Token events are coalesced by write time (emitter.py), so how many a 100-token run
    # makes depends on the machine's load; that several come, spread out, does not.
    assert len(tokens) >= 2
    # Buffered, every token would arrive together at the end; streamed, they spread out.
    assert finished - tokens[0] > 0.1, f"first token reached the client {finished - tokens[0]:.3f}s before the end"
    assert tokens[-1] - tokens[0] > 0.1


def _accepted(metrics: str) -> float:
    return sum(float(v) for v in re.findall(r"^gateway_requests_accepted_total\{[^}]*\} (\S+)$", metrics, re.M))


async def test_requests_spread_over_both_gateways(nginx_in_front) -> None:
    async with httpx.AsyncClient(headers=AUTH, timeout=30) as direct:
        before = [_accepted((await direct.get(f"{url}/metrics")).text) for url in nginx_in_front["gateways"]]
        async with httpx.AsyncClient(headers=AUTH, base_url=nginx_in_front["url"], timeout=60) as client:
            ids = await asyncio.gather(
                *(submit(client, {"model": "clip_text", "inputs": {"text": f"n{i}"}}) for i in range(30))
            )
            await asyncio.gather(*(wait_result(client, rid) for rid in ids))
        after = [_accepted((await direct.get(f"{url}/metrics")).text) for url in nginx_in_front["gateways"]]
    served = [a - b for a, b in zip(after, before, strict=False)]
    assert sum(served) == 30
    assert all(count > 0 for count in served), served


async def test_nginx_refuses_an_oversized_body_with_the_api_error_format(nginx_in_front) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=nginx_in_front["url"], timeout=30) as client:
        response = await client.post("/infer", content=b"x" * (9 * 1024 * 1024))
    assert response.status_code == 413
    assert response.json()["error"]["code"] == "payload_too_large"


async def test_a_file_upload_over_8_mib_passes_through_nginx(nginx_in_front) -> None:
    # /v1/files takes the gateway's MAX_FILE_BYTES (200 MiB); 9.5 MiB is over the 8 MiB
    # every other path keeps, and small enough for CI.
    line = b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
    content = line * (int(9.5 * 1024 * 1024) // len(line) + 1)
    async with httpx.AsyncClient(headers=AUTH, base_url=nginx_in_front["url"], timeout=120) as client:
        response = await client.post("/v1/files", files={"file": ("big.jsonl", content)}, data={"purpose": "batch"})
        assert response.status_code == 200, response.text
        uploaded = response.json()
        assert uploaded["bytes"] == len(content) > 9 * 1024 * 1024
        # Every other path still refuses a body of that size at nginx.
        refused = await client.post("/v1/embeddings", content=content)
        await client.delete(f"/v1/files/{uploaded['id']}")
    assert refused.status_code == 413
    assert refused.json()["error"]["code"] == "payload_too_large"


def test_a_responses_websocket_passes_through_nginx(stack, nginx_in_front) -> None:
    url = nginx_in_front["url"].replace("http://", "ws://") + "/v1/responses"
    with ws_client.connect(url, additional_headers={"Authorization": f"Bearer {stack.api_key}"}) as socket:
        create = {"type": "response.create", "model": "llm_echo", "input": "Through nginx", "max_output_tokens": 50}
        socket.send(json.dumps(create))
        events = []
        while not events or events[-1]["type"] not in ("response.completed", "response.incomplete", "error"):
            events.append(json.loads(socket.recv(timeout=120)))
    assert events[0]["type"] == "response.created" and events[-1]["type"] in (
        "response.completed",
        "response.incomplete",
    ), events[-1]


def _spooled(folder) -> int:
    """Bytes in nginx's client body temp files now."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def test_an_anonymous_upload_is_refused_while_it_arrives_and_never_spooled(nginx_in_front) -> None:
    # 150 MiB declared on the path that takes the most (POST /v1/files, 201m), no key. With
    # request buffering on (the base config) nginx wrote all of it to its temp files before a
    # gateway saw the headers, and the 401 came only after the last byte.
    total, chunk = 150 * 1024 * 1024, b"x" * (1024 * 1024)
    head = (
        f"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        f"Content-Length: {total}\r\n\r\n"
    ).encode()
    sent, largest, answer = 0, 0, b""
    with socket.create_connection(("127.0.0.1", nginx_in_front["port"]), timeout=60) as conn:
        conn.sendall(head)
        conn.setblocking(False)
        deadline = time.monotonic() + 120
        while b"\r\n\r\n" not in answer:
            assert time.monotonic() < deadline, f"no answer after {sent} bytes"
            try:
                data = conn.recv(65536)
                if not data:
                    break
                answer += data
                continue
            except BlockingIOError:
                pass
            except ConnectionResetError:
                break
            largest = max(largest, _spooled(nginx_in_front["bodies"]))
            if sent < total:
                try:
                    sent += conn.send(chunk[: total - sent])
                except BlockingIOError:
                    time.sleep(0.01)
                except (BrokenPipeError, ConnectionResetError):
                    break
            else:
                time.sleep(0.01)
    status = answer.split(b"\r\n", 1)[0]
    assert status.startswith(b"HTTP/1.1 401"), answer[:300]
    assert sent < total, "the refusal came only once the whole body was sent"
    assert largest == 0, f"nginx spooled {largest} bytes of an anonymous body"
