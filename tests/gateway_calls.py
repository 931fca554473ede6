"""Small helpers for tests that talk to a gateway over HTTP."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

TERMINAL = {"succeeded", "failed", "canceled", "expired"}


def llm_body(prompt: str = "Hello world", max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
    return {"model": "llm", "inputs": {"text_input": prompt, "max_tokens": max_tokens}, **extra}


async def submit(client: httpx.AsyncClient, body: dict[str, Any], **headers: str) -> str:
    response = await client.post("/infer", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return response.json()["request_id"]


async def wait_result(client: httpx.AsyncClient, request_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        response = await client.get(f"/results/{request_id}", params={"wait": 10})
        assert response.status_code == 200, response.text
        record = response.json()
        if record["status"] in TERMINAL:
            return record
        if time.monotonic() > deadline:
            raise AssertionError(f"{request_id} still {record['status']} after {timeout}s")


async def wait_all(client: httpx.AsyncClient, request_ids: list[str], timeout: float = 120) -> list[dict[str, Any]]:
    return await asyncio.gather(*(wait_result(client, rid, timeout) for rid in request_ids))


async def read_events(
    client: httpx.AsyncClient, request_id: str, *, last_event_id: str | None = None, limit: int | None = None
) -> list[dict[str, str]]:
    """Server-Sent Events of a request (stopping after `limit` events, like a client
    that disconnects), each as {"id", "event", "data"}; keep-alive comments skipped."""
    headers = {"Last-Event-ID": last_event_id} if last_event_id else {}
    events: list[dict[str, str]] = []
    current: dict[str, str] = {}
    async with client.stream("GET", f"/results/{request_id}/events", headers=headers) as response:
        assert response.status_code == 200, await response.aread()
        assert response.headers["content-type"].startswith("text/event-stream")
        async for line in response.aiter_lines():
            if not line:
                if current:
                    events.append(current)
                    current = {}
                    if limit is not None and len(events) >= limit:
                        break
                continue
            if line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            current[name] = value[1:] if value.startswith(" ") else value
    return events
