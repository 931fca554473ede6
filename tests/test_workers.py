"""`gateway serve --workers N`: several processes share the port, each with its own
dispatcher in the one consumer group and a listening socket of its own, and requests
are served, a burst of connections spread over the processes."""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from pathlib import Path

import httpx
import psutil

from tests.conftest import AUTH
from tests.gateway_calls import submit, wait_result


async def test_two_worker_processes_share_the_port_and_the_work(stack) -> None:
    redis_url = stack.redis_db_url(63)
    gateway, url = stack.start_gateway("gateway-workers", REDIS_URL=redis_url, GATEWAY_WORKERS="2")
    try:
        body = {"model": "llm_synthetic", "inputs": {"text_input": "share", "max_tokens": 10}}
        # Separate connections, so the kernel spreads them over both processes.
        clients = [httpx.AsyncClient(base_url=url, headers=AUTH, timeout=60) for _ in range(16)]
        try:
            ids = await asyncio.gather(*(submit(c, body) for c in clients))
            records = await asyncio.gather(*(wait_result(clients[0], rid) for rid in ids))
        finally:
            await asyncio.gather(*(c.aclose() for c in clients))
        assert {r["status"] for r in records} == {"succeeded"}
        # Each process logs its own start, under its own pid.
        log = (stack.data_dir / "logs" / "gateway-workers.log").read_text()
        pids = set(re.findall(r"Started server process \[(\d+)\]", log))
        assert len(pids) == 2, pids
    finally:
        stack.stop(gateway)


def _listening_sockets(port: int) -> list[str]:
    """The inodes of the sockets listening on the port (/proc/net/tcp, state 0A)."""
    inodes = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
            inodes.append(fields[9])
    return inodes


async def _listening_on(port: int, count: int, within_s: float = 180.0) -> list[str]:
    """The port's listening sockets once there are `count` (the gateway is ready when its
    first process answers; the other may still be starting), or as they are at the end."""
    deadline = time.monotonic() + within_s
    while len(inodes := _listening_sockets(port)) < count and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return inodes


async def test_each_worker_process_listens_on_a_socket_of_its_own(stack) -> None:
    gateway, url = stack.start_gateway("gateway-own-sockets", GATEWAY_WORKERS="2")
    try:
        # One socket each in the port's SO_REUSEPORT group (uvicorn alone: one, shared).
        assert len(await _listening_on(int(url.rsplit(":", 1)[1]), 2)) == 2
    finally:
        stack.stop(gateway)


async def test_a_burst_of_connections_spreads_over_the_worker_processes(stack) -> None:
    gateway, url = stack.start_gateway("gateway-burst-spread", GATEWAY_WORKERS="2")
    port = int(url.rsplit(":", 1)[1])
    clients = [httpx.AsyncClient(base_url=url, timeout=60) for _ in range(64)]
    try:
        assert len(await _listening_on(port, 2)) == 2  # both processes serving
        # 64 connections opened at once, each kept alive after its answer.
        answers = await asyncio.gather(*(c.get("/healthz") for c in clients))
        assert {a.status_code for a in answers} == {200}
        held: Counter[int] = Counter()
        for child in psutil.Process(gateway.pid).children(recursive=True):
            for conn in child.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_ESTABLISHED and conn.laddr.port == port:
                    held[child.pid] += 1
        assert sum(held.values()) == 64, held
        # The kernel hashes each connection to one of the two sockets: an even split
        # is 32 / 32, and fewer than 16 on one has odds of about 1 in 10,000.
        assert len(held) == 2 and min(held.values()) >= 16, held
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
        stack.stop(gateway)
