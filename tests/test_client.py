"""The client SDK (gateway.client) and the CLI commands that use it, against the real
local stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.client import AsyncGatewayClient, GatewayClient, GatewayError
from gateway.protocol import ResultRecord, State, new_request_id
from gateway.protocol.http import Accepted
from tests.conftest import AUTH

SAMPLING = {"seed": 1234, "top_k": 40, "temperature": 1.0}


def llm(prompt: str, max_tokens: int) -> dict:
    return {"text_input": prompt, "max_tokens": max_tokens}


def run_cli(stack, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GATEWAY_URL": stack.gateway_url}
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,  # the tests read the exit status
    )


def summary_line(completed: subprocess.CompletedProcess[str]) -> list[str]:
    """The CLI's last stderr line, "<id> <status> in <s>s...", split into words."""
    return completed.stderr.strip().splitlines()[-1].split()


@pytest.fixture
def client(stack) -> Iterator[GatewayClient]:
    with GatewayClient(stack.gateway_url, timeout=60) as sync_client:
        yield sync_client


@pytest.fixture(scope="module")
def idle_gateway(stack) -> Iterator[str]:
    """A gateway whose only replica does not exist, so what it accepts stays queued and a
    cancel always meets it there. Cancels are tested on queued work because the tiny CPU
    model writes all 250 tokens in about 0.5 s, no longer than a cancel of running work
    can take to land on a 2-core machine: a mid-generation cancel would race the end."""
    process, url = stack.start_gateway(
        "gateway-client-idle",
        ready_path="/healthz",
        REDIS_URL=stack.redis_db_url(40),
        TRITON_GRPC_URLS="127.0.0.1:9",
    )
    yield url
    stack.stop(process)


# -- The SDK -------------------------------------------------------------------------------


async def test_async_client_submit_then_wait_gives_the_succeeded_record(stack) -> None:
    async with AsyncGatewayClient(stack.gateway_url) as client:
        accepted = await client.submit("llm", llm("Hello", 8))
        assert isinstance(accepted, Accepted) and accepted.status == State.QUEUED
        record = await client.wait(accepted.request_id, timeout=60)
    assert record.request_id == accepted.request_id
    assert record.status == State.SUCCEEDED
    assert record.outputs and record.outputs["text_output"]


def test_sync_client_submit_then_wait_gives_the_succeeded_record(client) -> None:
    accepted = client.submit("text_embed", {"text": "a cat sits on the mat"})
    assert isinstance(accepted, Accepted)
    record = client.wait(accepted.request_id, timeout=60)
    assert record.status == State.SUCCEEDED
    assert len(record.outputs["embedding"]) == 384


def test_submit_with_wait_returns_the_record_itself(client) -> None:
    submitted = client.submit("clip_text", {"text": "a photo of a dog"}, wait=30)
    assert isinstance(submitted, ResultRecord)
    assert submitted.status == State.SUCCEEDED and submitted.outputs["text_embeds"]


def test_generate_gives_the_same_text_as_submit_and_wait(client) -> None:
    text = client.generate("Once upon", 12, parameters=SAMPLING)  # the prompt as a user turn
    chat = {"messages": [{"role": "user", "content": "Once upon"}], "max_tokens": 12}
    accepted = client.submit("llm", chat, parameters=SAMPLING)
    assert text and text == client.wait(accepted.request_id).outputs["text_output"]


def test_stream_text_yields_tokens_that_join_into_the_final_text(client) -> None:
    accepted = client.submit("llm", llm("Tell me", 24), stream=True)
    pieces = list(client.stream_text(accepted.request_id))
    assert len(pieces) >= 2
    assert "".join(pieces) == client.wait(accepted.request_id).outputs["text_output"]


async def test_async_generate_streams_pieces_that_join_into_the_text(stack) -> None:
    async with AsyncGatewayClient(stack.gateway_url) as client:
        pieces = [piece async for piece in await client.generate("Once upon", 12, stream=True, parameters=SAMPLING)]
        plain = await client.generate("Once upon", 12, parameters=SAMPLING)
    assert len(pieces) >= 2 and "".join(pieces) == plain


def test_cancel_through_the_client_ends_the_request_canceled(idle_gateway) -> None:
    with GatewayClient(idle_gateway) as client:
        accepted = client.submit("llm", llm("Cancel me", 250), stream=True)
        answer = client.cancel(accepted.request_id)
        assert answer.request_id == accepted.request_id and answer.status == State.CANCELED
        record = client.wait(accepted.request_id, timeout=30)
    assert record.status == State.CANCELED and record.started_at is None


def test_api_error_raises_gateway_error_with_its_stable_code(client) -> None:
    with pytest.raises(GatewayError) as caught:
        client.submit("no_such_model", {"text": "x"})
    assert caught.value.status == 422 and caught.value.code == "unknown_model"
    assert "no_such_model" in caught.value.message


def test_unknown_request_id_raises_not_found(client) -> None:
    with pytest.raises(GatewayError) as caught:
        client.result(new_request_id())  # well formed and recent, but never submitted
    assert caught.value.status == 404 and caught.value.code == "not_found"


class _DropAfter(httpx.SyncByteStream):
    """An SSE body cut off, as by a broken connection, after `events` whole events."""

    def __init__(self, inner: httpx.SyncByteStream, events: int) -> None:
        self.inner, self.events = inner, events

    def __iter__(self) -> Iterator[bytes]:
        buffer, sent = b"", 0
        for chunk in self.inner:
            buffer += chunk
            while b"\n\n" in buffer:  # each event ends with a blank line (LF line ends)
                event, buffer = buffer.split(b"\n\n", 1)
                yield event + b"\n\n"
                sent += 1
                if sent == self.events:
                    raise httpx.ReadError("connection dropped by the test")

    def close(self) -> None:
        self.inner.close()


class _DroppingTransport(httpx.HTTPTransport):
    """Cuts the first event stream short; later ones pass untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.event_requests: list[httpx.Request] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if not request.url.path.endswith("/events"):
            return response
        self.event_requests.append(request)
        if len(self.event_requests) > 1:
            return response
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=_DropAfter(response.stream, 4),
            extensions=response.extensions,
        )


def test_events_resume_with_last_event_id_after_a_dropped_connection(stack) -> None:
    transport = _DroppingTransport()
    http = httpx.Client(headers=AUTH, base_url=stack.gateway_url, transport=transport, timeout=60)
    with GatewayClient(stack.gateway_url, http=http) as client:
        accepted = client.submit("llm", llm("Once upon", 40), stream=True, parameters=SAMPLING)
        events = list(client.events(accepted.request_id))
    assert len(transport.event_requests) == 2
    assert transport.event_requests[1].headers["Last-Event-ID"] == events[3].id
    ids = [event.id for event in events]
    assert len(ids) == len(set(ids))
    assert events[0].kind == "queued" and events[-1].kind == "completed"
    streamed = "".join(event.text for event in events)
    assert streamed and streamed == events[-1].record.outputs["text_output"]


# -- The CLI -------------------------------------------------------------------------------


def test_cli_infer_stream_prints_the_text_and_exits_0(stack, client) -> None:
    completed = run_cli(stack, "infer", "Once upon a time", "--stream", "--max-tokens", "16", "--seed", "7")
    assert completed.returncode == 0, completed.stderr
    request_id, status = summary_line(completed)[:2]
    assert status == "succeeded"
    record = client.wait(request_id)
    assert record.outputs["text_output"]
    assert completed.stdout == record.outputs["text_output"] + "\n"
    assert "running" in completed.stderr  # progress went to stderr, not into the text


def test_cli_infer_stop_after_ms_cancels_and_keeps_what_arrived(stack, idle_gateway) -> None:
    completed = run_cli(
        stack, "infer", "Cancel me", "--stream", "--max-tokens", "250", "--stop-after-ms", "300", "--url", idle_gateway
    )
    assert completed.returncode == 0, completed.stderr
    request_id, status, _, took = summary_line(completed)[:4]
    assert status == "canceled" and "stopped after 300 ms" in completed.stderr
    assert float(took.rstrip("s,")) >= 0.3  # it held on until the stop time
    with GatewayClient(idle_gateway) as client:
        record = client.wait(request_id, timeout=30)
        tokens = [event.text for event in client.events(request_id) if event.kind == "token"]
    assert record.status == State.CANCELED
    assert len(tokens) < 250
    printed = "".join(tokens)
    assert completed.stdout == (printed + "\n" if printed else "")


def test_cli_infer_of_an_unknown_model_exits_1_with_the_code(stack) -> None:
    completed = run_cli(stack, "infer", "hello", "--model", "no_such_model")
    assert completed.returncode == 1
    assert "unknown_model" in completed.stderr and completed.stdout == ""


def test_cli_infer_of_an_embedding_model_prints_a_json_summary(stack) -> None:
    completed = run_cli(stack, "infer", "a cat sits on the mat", "--model", "text_embed")
    assert completed.returncode == 0, completed.stderr
    summary = json.loads(completed.stdout)
    assert summary["status"] == "succeeded" and summary["outputs"]["embedding"]["dim"] == 384


def test_cli_result_prints_the_finished_record(stack, client) -> None:
    record = client.submit("text_embed", {"text": "result on the command line"}, wait=30)
    assert isinstance(record, ResultRecord)
    completed = run_cli(stack, "result", record.request_id, "--wait", "5")
    assert completed.returncode == 0, completed.stderr
    printed = json.loads(completed.stdout)
    assert printed["request_id"] == record.request_id and printed["status"] == "succeeded"
    assert printed["outputs"]["embedding"] == record.outputs["embedding"]


def test_cli_watch_prints_each_event_of_a_finished_request(stack, client) -> None:
    accepted = client.submit("llm", llm("Watch me", 8), stream=True)
    record = client.wait(accepted.request_id)
    completed = run_cli(stack, "watch", accepted.request_id)
    assert completed.returncode == 0, completed.stderr
    events = [json.loads(line) for line in completed.stdout.splitlines()]
    assert [e["event"] for e in events][:2] == ["queued", "running"] and events[-1]["event"] == "completed"
    tokens = "".join(e["data"]["text_output"] for e in events if e["event"] == "token")
    assert tokens == record.outputs["text_output"]


def test_cli_search_returns_the_nearest_stored_result(stack, client) -> None:
    text = "a red fox jumps over the sleeping dog"
    record = client.submit("text_embed", {"text": text}, wait=30)
    assert isinstance(record, ResultRecord) and record.status == State.SUCCEEDED
    deadline = time.monotonic() + 30
    while record.request_id not in {hit.request_id for hit in client.search(text=text, k=10).hits}:
        assert time.monotonic() < deadline, "the binder never indexed the result"
        time.sleep(0.2)
    completed = run_cli(stack, "search", text, "-k", "10")
    assert completed.returncode == 0, completed.stderr
    found = json.loads(completed.stdout)
    assert found["space"] == "minilm"
    hits = {hit["request_id"]: hit for hit in found["hits"]}
    assert record.request_id in hits
    assert hits[record.request_id]["score"] > 0.99 and hits[record.request_id]["inputs"] == {"text": text}
