"""The OpenAI-compatible API with the official `openai` package, unmodified, sync and
async clients pointed at the gateway. Every call is an ordinary durable request."""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import AUTH
from tests.test_tenants import client_for, new_key, set_tenant, slot_held

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}]


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=60)


@pytest.fixture
async def aclient(stack):
    client = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=60)
    yield client
    await client.close()


def _record(stack, request_id: str) -> dict:
    return httpx.get(
        headers=AUTH, url=f"{stack.gateway_url}/results/{request_id}", params={"wait": 30}, timeout=60
    ).json()


def test_the_models_of_the_registry_are_listed(client) -> None:
    names = {model.id for model in client.models.list()}
    assert {"llm", "text_embed", "clip_text"} <= names
    assert client.models.retrieve("llm").id == "llm"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_a_chat_completion_has_text_usage_and_a_durable_record(client, stack) -> None:
    raw = client.chat.completions.with_raw_response.create(model="llm_echo", messages=MESSAGES, max_tokens=200)
    completion = raw.parse()
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert completion.choices[0].message.content == expected  # the echo engine returns the rendered prompt
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens == completion.usage.completion_tokens > 0
    request_id = raw.headers["x-request-id"]
    assert completion.id == f"chatcmpl-{request_id}"
    record = _record(stack, request_id)
    assert record["status"] == "succeeded" and record["metadata"]["api"] == "chat.completions"


async def test_an_async_chat_completion_works_with_the_async_client(aclient) -> None:
    completion = await aclient.chat.completions.create(model="llm", messages=MESSAGES, max_tokens=8, seed=3)
    assert completion.choices[0].message.role == "assistant"
    assert completion.usage.completion_tokens <= 8


def test_streaming_with_include_usage_ends_with_a_usage_chunk(client) -> None:
    stream = client.chat.completions.create(
        model="llm_echo", messages=MESSAGES, max_tokens=200, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.endswith("<|im_start|>assistant\n")
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2


def test_a_completion_returns_text_and_finish_reason_length(client) -> None:
    completion = client.completions.create(model="llm_echo", prompt="one two three four five six", max_tokens=3)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3
    assert completion.choices[0].text


def test_embeddings_as_floats_and_as_base64_are_the_same_unit_vectors(client) -> None:
    floats = client.embeddings.create(model="text_embed", input=["a cat sits on the mat", "stock markets"])
    encoded = client.embeddings.create(model="text_embed", input="a cat sits on the mat", encoding_format="base64")
    assert [d.index for d in floats.data] == [0, 1]
    vector = np.asarray(floats.data[0].embedding)
    assert vector.shape == (384,) and abs(float(np.linalg.norm(vector)) - 1) < 1e-3
    # The SDK decodes base64 itself when it asked for it; ask raw to see the encoding.
    raw = httpx.post(
        str(client.base_url) + "embeddings",
        headers=AUTH,
        json={"model": "text_embed", "input": "a cat sits on the mat", "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vector, atol=1e-6)
    assert encoded.data[0].embedding == raw["data"][0]["embedding"]
    assert floats.usage.prompt_tokens > 0


def test_an_unsupported_dimensions_is_refused_clearly(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="text_embed", input="x", dimensions=128)
    assert caught.value.code == "unsupported_parameter"
    assert "384" in caught.value.message


def test_fields_that_are_not_served_are_refused_by_name_not_ignored(client) -> None:
    # (Neutral values, such as an empty logit_bias, ask for nothing and are accepted.)
    for extra, param in (
        ({"some_future_field": {"nested": True}}, "some_future_field"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model="llm", messages=MESSAGES, max_tokens=4, extra_body={"logit_bias": {}, **extra}
            )
        assert caught.value.code == "unsupported_parameter" and caught.value.body["param"] == param


def test_errors_come_in_openais_error_shape(client, stack) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert missing.value.code == "model_not_found" and missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as n:
        client.chat.completions.create(model="llm", messages=MESSAGES, n=100)
    assert n.value.code == "unsupported_parameter" and n.value.body["param"] == "n"
    response = httpx.post(headers=AUTH, url=f"{stack.gateway_url}/v1/chat/completions", json={"model": "llm"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == "messages"


def test_a_background_response_is_queued_at_once_then_polled_to_completion(client) -> None:
    response = client.responses.create(model="llm_echo", input="Poll me", background=True, max_output_tokens=100)
    assert response.status in ("queued", "in_progress")
    assert response.background is True
    deadline = time.monotonic() + 30
    while response.status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.1)
        response = client.responses.retrieve(response.id)
    assert response.status == "completed"
    assert response.output_text.endswith("<|im_start|>user\nPoll me<|im_end|>\n<|im_start|>assistant\n")
    assert response.usage.output_tokens > 0


async def test_a_queued_background_response_reads_as_background_with_its_metadata(stack) -> None:
    await set_tenant(stack, "tenant-queued-response", limits={"max_concurrent": 1})
    key = await new_key(stack, "tenant-queued-response")
    tenant = openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0, timeout=60)
    async with tenant, client_for(stack, key) as native, slot_held(native):  # so the response stays queued
        created = await tenant.responses.create(
            model="llm_echo", input="Wait your turn", background=True, metadata={"job": "nightly"}
        )
        try:
            queued = await tenant.responses.retrieve(created.id)
        finally:
            await tenant.responses.cancel(created.id)
    assert queued.status == "queued"
    assert queued.background is True
    assert queued.metadata == {"job": "nightly"}


def test_a_background_stream_resumes_after_a_disconnect_with_starting_after(client) -> None:
    stream = client.responses.create(
        model="llm_synthetic", input="Tell a story", background=True, stream=True, max_output_tokens=40
    )
    seen = []
    for event in stream:
        seen.append(event)
        if sum(1 for e in seen if e.type == "response.output_text.delta") == 5:
            break  # the client goes away mid-stream
    stream.close()
    response_id = next(e.response.id for e in seen if e.type == "response.created")
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=seen[-1].sequence_number))
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(len(numbers)))  # nothing lost, nothing repeated
    text = "".join(e.delta for e in seen + rest if e.type == "response.output_text.delta")
    final = client.responses.retrieve(response_id)
    assert rest[-1].type in ("response.completed", "response.incomplete")
    assert text == final.output_text and text


def test_a_background_response_can_be_cancelled(client) -> None:
    response = client.responses.create(model="llm_synthetic", input="Go on", background=True, max_output_tokens=400)
    time.sleep(0.5)
    cancelled = client.responses.cancel(response.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(response.id).status == "cancelled"


def _active(stack, model: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "nv_trt_llm_request_metrics"
                and sample.labels.get("model") == model
                and sample.labels.get("request_type") == "active"
            ):
                return sample.value
    return 0.0


async def test_a_streamed_chat_whose_client_disconnects_stops_the_generation(aclient, stack) -> None:
    raw = await aclient.chat.completions.with_raw_response.create(
        model="llm_synthetic", messages=MESSAGES, max_tokens=300, stream=True
    )
    request_id = raw.headers["x-request-id"]
    stream = raw.parse()
    received = 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            received += 1
        if received == 4:
            break
    await stream.close()  # the client goes away
    deadline = time.monotonic() + 2
    while _active(stack, "llm_synthetic") > 0:
        assert time.monotonic() < deadline, "the engine is still generating"
        await asyncio.sleep(0.05)
    record = _record(stack, request_id)
    assert record["status"] == "canceled"
    assert record["usage"]["completion_tokens"] < 300
