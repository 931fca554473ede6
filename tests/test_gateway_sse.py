"""Server-Sent Events: queued, running, tokens, then the terminal event; every event
has an id, and Last-Event-ID resumes with nothing lost or repeated."""

from __future__ import annotations

import json

import pytest

from tests.gateway_calls import llm_body, read_events, submit, wait_result

SAMPLING = {"seed": 1234, "top_k": 40, "temperature": 1.0}


async def test_stream_has_queued_running_tokens_then_completed(http) -> None:
    request_id = await submit(http, llm_body("Tell me", 24, stream=True))
    events = await read_events(http, request_id)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "queued" and kinds[1] == "running" and kinds[-1] == "completed"
    assert kinds.count("token") >= 2
    assert all(e["id"] for e in events)
    assert len({e["id"] for e in events}) == len(events)
    final = json.loads(events[-1]["data"])
    tokens = "".join(json.loads(e["data"])["text_output"] for e in events if e["event"] == "token")
    assert final["outputs"]["text_output"] == tokens


async def test_resume_with_last_event_id_loses_and_repeats_nothing(http) -> None:
    streamed_id = await submit(http, llm_body("Once upon", 40, stream=True, parameters=SAMPLING))
    first = await read_events(http, streamed_id, limit=4)  # disconnect part-way
    rest = await read_events(http, streamed_id, last_event_id=first[-1]["id"])
    events = first + rest
    ids = [e["id"] for e in events]
    assert len(ids) == len(set(ids)) and events[-1]["event"] == "completed"
    joined = "".join(json.loads(e["data"])["text_output"] for e in events if e["event"] == "token")

    plain_id = await submit(http, llm_body("Once upon", 40, stream=False, parameters=SAMPLING))
    plain = await wait_result(http, plain_id)
    assert joined == plain["outputs"]["text_output"]
    assert joined


async def test_client_arriving_after_completion_gets_the_whole_replay(http) -> None:
    request_id = await submit(http, llm_body("Late", 8, stream=True))
    await wait_result(http, request_id)
    events = await read_events(http, request_id)
    assert [e["event"] for e in events][:2] == ["queued", "running"]
    assert events[-1]["event"] == "completed"


async def test_embedding_request_streams_an_output_event(http) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "sse"}})
    kinds = [e["event"] for e in await read_events(http, request_id)]
    assert kinds == ["queued", "running", "output", "completed"]


async def test_resuming_after_any_event_gives_exactly_the_events_after_it(http) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "resume"}})
    events = await read_events(http, request_id)
    assert [e["event"] for e in events] == ["queued", "running", "output", "completed"]
    for i, event in enumerate(events[:-1]):
        assert await read_events(http, request_id, last_event_id=event["id"]) == events[i + 1 :], event


@pytest.mark.parametrize("last_event_id", ["garbage", "1-2-1", "1-2-0-0", "-1-2"])
async def test_malformed_last_event_id_is_422(http, last_event_id: str) -> None:
    request_id = await submit(http, {"model": "clip_text", "inputs": {"text": "sse"}})
    response = await http.get(f"/results/{request_id}/events", headers={"Last-Event-ID": last_event_id})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_last_event_id"


async def test_submit_with_accept_event_stream_answers_with_the_events(http) -> None:
    body = llm_body("Stream it back", 12, stream=True)
    async with http.stream("POST", "/infer", json=body, headers={"Accept": "text/event-stream"}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        request_id = response.headers["location"].rsplit("/", 1)[-1]
        kinds = [line.split(":", 1)[1].strip() async for line in response.aiter_lines() if line.startswith("event:")]
    assert kinds[0] == "queued" and kinds[-1] == "completed" and "token" in kinds
    assert (await wait_result(http, request_id))["status"] == "succeeded"
