"""Cancel: queued work never runs; running work has its Triton stream cancelled and
Triton stops generating."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.conftest import AUTH
from tests.gateway_calls import llm_body, read_events, submit, wait_result


async def _postprocessed(triton) -> int:
    stats = await triton.get_inference_statistics("llm_postprocessing", as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


async def test_cancel_mid_stream_ends_canceled_with_fewer_tokens_and_triton_stops(http, triton) -> None:
    before = await _postprocessed(triton)
    request_id = await submit(http, llm_body("Cancel me", 250, stream=True))
    events = await read_events(http, request_id, limit=5)  # queued, running, 3 tokens
    assert [e["event"] for e in events][-1] == "token"
    response = await http.post(f"/results/{request_id}/cancel")
    assert response.status_code == 200, response.text
    assert response.json()["status"] == "canceled"

    record = await wait_result(http, request_id)
    assert record["status"] == "canceled"
    partial = record["outputs"]["text_output"] if record["outputs"] else ""
    await asyncio.sleep(2.0)  # time enough for 250 tokens, had generation gone on
    generated = await _postprocessed(triton) - before
    assert generated < 60, f"Triton generated {generated} chunks after the cancel"
    assert len(partial) < 250 * 2

    assert (await http.get("/readyz")).status_code == 200
    again = await http.post("/infer", json=llm_body("after cancel", 4), headers={"Prefer": "wait=30"})
    assert again.json()["status"] == "succeeded"


async def test_cancel_of_a_finished_request_is_409(http) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "done"}})
    await wait_result(http, request_id)
    response = await http.post(f"/results/{request_id}/cancel")
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "already_finished"


@pytest.fixture(scope="module")
def idle_gateway(stack):
    """A gateway whose only replica does not exist: what it accepts stays queued."""
    process, url = stack.start_gateway(
        "gateway-idle",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(6),
        TRITON_GRPC_URLS="127.0.0.1:9",
    )
    yield url
    stack.stop(process)


async def test_cancel_of_a_queued_request_means_it_never_runs(idle_gateway) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=idle_gateway, timeout=30) as client:
        request_id = await submit(client, llm_body("never", 4))
        response = await client.post(f"/results/{request_id}/cancel")
        assert response.status_code == 200
        assert response.json()["status"] == "canceled"
        record = await wait_result(client, request_id)
        assert record["status"] == "canceled"
        assert record["started_at"] is None and record["attempts"] == 0
        events = await read_events(client, request_id)
        assert [e["event"] for e in events] == ["queued", "canceled"]
        assert json.loads(events[-1]["data"])["status"] == "canceled"


async def test_a_request_nobody_can_run_expires_at_its_deadline(idle_gateway) -> None:
    async with httpx.AsyncClient(headers=AUTH, base_url=idle_gateway, timeout=30) as client:
        request_id = await submit(client, {**llm_body("too late", 4), "timeout_s": 1})
        record = await wait_result(client, request_id, timeout=10)
        assert record["status"] == "expired"
        assert record["error"]["code"] == "deadline_exceeded"
