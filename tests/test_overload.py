"""Overload shed at the edge, against a gateway process of its own: with
MAX_INFLIGHT_REQUESTS=2, while two requests are begun and not answered, a third is 503
`overloaded` with Retry-After at once (nothing of it read, its key not checked), health
and metrics are still served, and once the two have gone a request is served again; with
a small MAX_LOOP_LAG_S, a process whose loop runs behind sheds the same way."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import AUTH


async def _inflight(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    for family in text_string_to_metric_families(text):
        if family.name == "gateway_http_inflight":
            return family.samples[0].value
    raise AssertionError("no gateway_http_inflight gauge")


async def _until_inflight(client: httpx.AsyncClient, wanted: int) -> None:
    deadline = time.monotonic() + 60
    while await _inflight(client) != wanted:
        assert time.monotonic() < deadline, f"in flight never reached {wanted}"
        await asyncio.sleep(0.05)


def _half_sent(url: str) -> socket.socket:
    """A POST /infer whose body never finishes arriving: begun, not answered (until its
    body timeout, or this socket closes)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port))
    head = (
        f"POST /infer HTTP/1.1\r\nHost: {parts.hostname}\r\nAuthorization: {AUTH['Authorization']}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    sock.sendall(head.encode())
    return sock


async def test_past_its_inflight_limit_a_process_answers_503_overloaded_at_once(stack) -> None:
    process, url = stack.start_gateway("gateway-overload", GATEWAY_WORKERS="1", MAX_INFLIGHT_REQUESTS="2")
    held: list[socket.socket] = []
    try:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            held = [_half_sent(url) for _ in range(2)]
            await _until_inflight(client, 2)  # (/metrics is exempt from the limit)
            body = {"model": "llm_echo", "inputs": {"text_input": "one more", "max_tokens": 4}}
            refused = await client.post("/infer", json=body)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "overloaded"
            assert refused.headers["retry-after"] == "1"
            assert (await client.get("/healthz")).status_code == 200
            assert (await client.get("/readyz")).status_code == 200
            for sock in held:
                sock.close()
            await _until_inflight(client, 0)
            served = await client.post("/infer", json=body)
            assert served.status_code == 202, served.text
    finally:
        for sock in held:
            sock.close()
        stack.stop(process)


async def test_long_polls_waiting_are_not_counted_as_work_in_flight(stack) -> None:
    """A long poll is bounded by the event hub's pool and its tenant's share of it, not by
    the overload shed: a tenant's waiting polls leave another's calls served."""
    process, url = stack.start_gateway("gateway-overload-polls", GATEWAY_WORKERS="1", MAX_INFLIGHT_REQUESTS="2")
    try:
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) as client:
            body = {"model": "llm_synthetic", "inputs": {"text_input": "a long one", "max_tokens": 2000}}
            ids = [(await client.post("/infer", json=body)).json()["request_id"] for _ in range(3)]
            polls = [asyncio.create_task(client.get(f"/results/{rid}", params={"wait": 30})) for rid in ids]
            await _until_inflight(client, 3)  # begun and unanswered, all three waiting
            served = await client.post("/infer", json={**body, "inputs": {"text_input": "x", "max_tokens": 1}})
            assert served.status_code == 202, served.text
            for rid in ids:
                await client.post(f"/results/{rid}/cancel")
            for poll in polls:
                assert (await poll).status_code == 200
    finally:
        stack.stop(process)


async def _infer_on_a_connection_of_its_own(url: str, body: dict[str, Any]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=120) as client:
        return await client.post("/infer", json=body)


async def test_a_process_whose_loop_runs_behind_sheds_new_requests_with_503_overloaded(stack) -> None:
    """A process starved of its loop's time (here stopped for two seconds, as a small
    machine's CPU-bound Triton starves it: bench/overload_wait.py) runs behind by more than
    MAX_LOOP_LAG_S: the requests that queued meanwhile are refused 503 `overloaded` with
    Retry-After at once rather than each waiting its turn, and once it has caught up a
    request is served again. On 7904e6b every one of them was served, late."""
    process, url = stack.start_gateway("gateway-overload-lag", GATEWAY_WORKERS="1", MAX_LOOP_LAG_S="0.05")
    body = {"model": "llm_echo", "inputs": {"text_input": "behind", "max_tokens": 1}}
    pid = process.pid
    assert pid is not None
    try:
        assert (await _infer_on_a_connection_of_its_own(url, body)).status_code == 202
        os.kill(pid, signal.SIGSTOP)
        try:
            # Connections queue in the kernel while the process is stopped: what it will
            # find waiting when it runs again. The stop itself is the hostile input.
            calls = [asyncio.create_task(_infer_on_a_connection_of_its_own(url, body)) for _ in range(8)]
            await asyncio.sleep(2.0)
        finally:
            os.kill(pid, signal.SIGCONT)
        answers = await asyncio.gather(*calls)
        refused = [a for a in answers if a.status_code == 503]
        assert refused, [a.status_code for a in answers]
        assert all(a.json()["error"]["code"] == "overloaded" for a in refused)
        assert all(a.headers["retry-after"] == "1" for a in refused)
        assert "behind" in refused[0].json()["error"]["message"]
        deadline = time.monotonic() + 60
        while (served := await _infer_on_a_connection_of_its_own(url, body)).status_code == 503:
            assert time.monotonic() < deadline, "still shedding a minute after it ran again"
            await asyncio.sleep(0.05)
        assert served.status_code == 202, served.text
    finally:
        os.kill(pid, signal.SIGCONT)
        stack.stop(process)
