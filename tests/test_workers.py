"""`gateway serve --workers N`: several processes share the port, each with its own
dispatcher in the one consumer group, and requests are served."""

from __future__ import annotations

import asyncio
import re

import httpx

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
