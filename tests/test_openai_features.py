"""The OpenAI features beyond plain text, with the official `openai` package, unmodified,
against the real stack: tools (a call, then the tool's result, then the answer; streamed
and not), structured outputs that validate against their schema, logprobs with top
alternatives, n choices with summed usage, cached tokens from the engine's prefix cache,
service tiers (flex below interactive traffic), prompt_cache_key affinity, refusal of what
is not served (400 naming the field), and OpenAI-style webhooks signed per Standard
Webhooks for background responses and batches.

The LLM here is a tiny random GPT-2 (and the synthetic engine, for prompts beyond its 256
tokens): its text is noise, so tool calls and JSON come from guided decoding (a forced tool
choice, a response format), which is what is under test."""

from __future__ import annotations

import asyncio
import io
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import jsonschema
import openai
import pytest
import pytest_asyncio
import uvicorn
from standardwebhooks import Webhook

from gateway.stack.process import free_port
from tests.conftest import AUTH

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city now.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Tools need a long prompt (their description), beyond the tiny GPT-2's 256 tokens: the
# synthetic engine (seeded random logits under the guide, an 8192-token context) serves them.
TOOLS_MODEL = "llm_synthetic"
FORCED = {"type": "function", "function": {"name": "get_weather"}}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "member": {"type": "boolean"},
        "tier": {"type": "string", "enum": ["gold", "silver"]},
    },
    "required": ["name", "age", "member", "tier"],
    "additionalProperties": False,
}


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _record(stack, request_id: str, key: str | None = None, gateway: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else AUTH
    url = f"{gateway or stack.gateway_url}/results/{request_id}"
    return httpx.get(url, headers=headers, params={"wait": 30}, timeout=60).json()


def _tenant(stack, name: str, **settings) -> str:
    """A new tenant with these settings; its API key."""
    tenant = f"{name}-{time.time_ns()}"
    created = httpx.post(f"{stack.gateway_url}/admin/keys", headers=AUTH, json={"tenant": tenant}, timeout=30)
    assert created.status_code == 201, created.text
    if settings:
        put = httpx.put(f"{stack.gateway_url}/admin/tenants/{tenant}", headers=AUTH, json=settings, timeout=30)
        assert put.status_code == 200, put.text
    return created.json()["key"]


def _until(check, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} not reached in time"
        time.sleep(0.05)


def _forced_call(client: openai.OpenAI):
    return client.chat.completions.create(
        model=TOOLS_MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=FORCED, max_tokens=60
    )


def _with_result(call) -> list[dict]:
    """The conversation after the call: the assistant's call and the tool's result."""
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21, "sky": "clear"})}
    return [*QUESTION, assistant, result]


# -- tools --------------------------------------------------------------------------------


def test_a_tool_round_trip_calls_then_answers_from_the_result(client) -> None:
    first = _forced_call(client)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    second = client.chat.completions.create(
        model=TOOLS_MODEL, messages=_with_result(call), tools=[WEATHER], max_tokens=8
    )
    answer = second.choices[0]
    assert answer.message.role == "assistant" and answer.message.tool_calls is None
    assert answer.finish_reason in ("stop", "length") and isinstance(answer.message.content, str)
    # The result was in the prompt: the second turn's prompt is longer by the call and the result.
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_a_streamed_tool_round_trip_calls_then_answers(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model=TOOLS_MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="required", max_tokens=60, stream=True
        )
    )
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) == 1 and deltas[0].index == 0 and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads(deltas[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
    call = openai.types.chat.ChatCompletionMessageToolCall(
        id=deltas[0].id, type="function", function={"name": "get_weather", "arguments": deltas[0].function.arguments}
    )
    answer = list(
        client.chat.completions.create(model=TOOLS_MODEL, messages=_with_result(call), max_tokens=6, stream=True)
    )
    assert not any(c.choices[0].delta.tool_calls for c in answer)
    assert [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason] in (["stop"], ["length"])


def test_tools_calls_and_results_are_rendered_into_the_prompt(client) -> None:
    # llm_echo answers with its prompt: the template's view of the conversation.
    call = _forced_call(client).choices[0].message.tool_calls[0]
    offered = client.chat.completions.create(
        model="llm_echo", messages=QUESTION, tools=[WEATHER], tool_choice="auto", max_tokens=400
    )
    assert "<tools>" in offered.choices[0].message.content and "get_weather" in offered.choices[0].message.content
    echoed = client.chat.completions.create(
        model="llm_echo", messages=_with_result(call), tools=[WEATHER], tool_choice="none", max_tokens=400
    )
    prompt = echoed.choices[0].message.content
    assert "<tools>" not in prompt  # tool_choice none: no tools offered
    block = json.dumps({"name": "get_weather", "arguments": json.loads(call.function.arguments)})
    assert f"<|im_start|>assistant\n<tool_call>\n{block}\n</tool_call><|im_end|>" in prompt
    assert '<|im_start|>user\n<tool_response>\n{"temperature_c": 21, "sky": "clear"}\n</tool_response>' in prompt


# -- structured outputs ------------------------------------------------------------------


def test_a_json_schema_response_validates_against_the_schema(client) -> None:
    completion = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Describe a member as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=120,
        temperature=0,
    )
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].message.content), PERSON)


def test_a_json_object_response_is_a_json_object(client) -> None:
    completion = client.chat.completions.create(
        model="llm",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        temperature=0,
    )
    choice = completion.choices[0]
    # Greedy decoding of a fixed (seeded) model: the same object every time, closed well within
    # max_tokens. An object cut by max_tokens would not be the whole answer a client can parse.
    assert choice.finish_reason == "stop", choice
    assert isinstance(json.loads(choice.message.content), dict), choice.message.content


# -- logprobs -----------------------------------------------------------------------------


def test_logprobs_come_for_every_token_with_the_top_alternatives(client) -> None:
    completion = client.chat.completions.create(
        model="llm", messages=QUESTION, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens > 0
    assert "".join(bytes(entry.bytes).decode("utf-8", "replace") for entry in content).startswith(
        completion.choices[0].message.content[:1]
    )
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].token == entry.token and abs(entry.top_logprobs[0].logprob - entry.logprob) < 1e-3


def test_streamed_logprobs_arrive_with_the_last_chunk(client) -> None:
    chunks = list(
        client.chat.completions.create(
            model="llm",
            messages=QUESTION,
            max_tokens=6,
            logprobs=True,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(entries) == chunks[-1].usage.completion_tokens


def test_a_completion_returns_legacy_logprobs(client) -> None:
    completion = client.completions.create(model="llm", prompt="Once upon a time", max_tokens=5, logprobs=2)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and logprobs.text_offset[0] == 0


def test_logprobs_are_refused_by_name_on_the_llmapi_contract(client) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="llm_llmapi", messages=QUESTION, max_tokens=4, logprobs=True)
    assert caught.value.code == "unsupported_parameter" and caught.value.body["param"] == "logprobs"


# -- n ------------------------------------------------------------------------------------


N_SEED = 4321


def test_n_3_gives_three_whole_distinct_choices_that_the_seed_repeats_and_usage_of_all(client, stack) -> None:
    def call():
        raw = client.chat.completions.with_raw_response.create(
            model="llm", messages=QUESTION, n=3, max_tokens=12, temperature=1.0, seed=N_SEED
        )
        return raw.parse(), raw.headers["x-request-id"].split(",")

    completion, request_ids = call()
    # n choices, indexed 0..n-1, each a whole answer of its own (ended by the model or by
    # max_tokens; a random model may end one at once: "" is then the whole answer).
    assert [c.index for c in completion.choices] == [0, 1, 2]
    assert all(c.message.role == "assistant" and isinstance(c.message.content, str) for c in completion.choices)
    assert all(c.finish_reason in ("stop", "length") for c in completion.choices), completion
    # Distinct draws: each choice samples with its own seed (the call's + its index) ...
    texts = [c.message.content for c in completion.choices]
    assert len(set(texts)) == 3, texts
    # ... and the same seed repeats the whole response, choice by choice.
    again, again_ids = call()
    assert [(c.index, c.message.content, c.finish_reason) for c in again.choices] == [
        (c.index, c.message.content, c.finish_reason) for c in completion.choices
    ]
    assert set(again_ids).isdisjoint(request_ids)  # run again, not replayed
    # One request per choice, in order: its seed, its text, its length.
    records = [_record(stack, rid) for rid in request_ids]
    assert [r["status"] for r in records] == ["succeeded"] * 3
    assert [r["parameters"]["seed"] for r in records] == [N_SEED, N_SEED + 1, N_SEED + 2]
    assert [r["outputs"]["text_output"] for r in records] == texts
    for choice, record in zip(completion.choices, records, strict=True):
        assert record["outputs"]["finish_reason"] == choice.finish_reason, record
        if choice.finish_reason == "length":  # cut by max_tokens: all 12 were generated
            assert record["usage"]["completion_tokens"] == 12, record
        else:  # the model ended it, maybe at once (its end token is not counted)
            assert 0 <= record["usage"]["completion_tokens"] <= 12, record
    # Usage counts every choice (the gateway sums its requests' usage, the prompt's included).
    prompt_tokens = records[0]["usage"]["prompt_tokens"]
    assert all(r["usage"]["prompt_tokens"] == prompt_tokens > 0 for r in records)
    assert completion.usage.prompt_tokens == 3 * prompt_tokens
    assert completion.usage.completion_tokens == sum(r["usage"]["completion_tokens"] for r in records)
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + completion.usage.completion_tokens
    usage = (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)
    assert (again.usage.prompt_tokens, again.usage.completion_tokens, again.usage.total_tokens) == usage


def test_n_streamed_chunks_carry_each_choices_index(client, stack) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="llm", messages=QUESTION, n=3, max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(raw.parse())
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1, 2]
    records = [_record(stack, rid) for rid in raw.headers["x-request-id"].split(",")]
    assert chunks[-1].usage.completion_tokens == sum(r["usage"]["completion_tokens"] for r in records)


# -- cached tokens ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["llm", "llm_llmapi"])  # the engine contract and the llmapi one
def test_cached_tokens_count_a_repeated_long_prefix(client, model) -> None:
    prefix = " ".join(f"rule {i}: be brief." for i in range(6))  # ~150 tokens with this tokenizer: 4 blocks
    messages = [{"role": "system", "content": f"{model}: {prefix}"}, {"role": "user", "content": "Hello?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    again = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 64
    assert again.usage.prompt_tokens_details.cached_tokens >= 64
    assert again.usage.prompt_tokens_details.cached_tokens % 32 == 0


@pytest.mark.parametrize("model", ["llm", "llm_llmapi"])
def test_another_tenants_cached_tokens_for_your_prompt_are_0(stack, client, model) -> None:
    prefix = " ".join(f"secret clause {i}: do not share." for i in range(6))  # 4 blocks and more
    messages = [{"role": "system", "content": f"{model} {time.time_ns()}: {prefix}"}, {"role": "user", "content": "Hi"}]
    for _ in range(2):  # the first tenant's prompt is in every cache now
        mine = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    assert mine.usage.prompt_tokens_details.cached_tokens >= 64
    other = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=_tenant(stack, "guesser"), max_retries=0)
    raw = other.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=2)
    theirs = raw.parse()
    assert theirs.usage.prompt_tokens == mine.usage.prompt_tokens
    assert theirs.usage.prompt_tokens_details.cached_tokens == 0
    record = httpx.get(
        f"{stack.gateway_url}/results/{raw.headers['x-request-id']}",
        headers={"Authorization": f"Bearer {other.api_key}"},
        timeout=30,
    ).json()
    assert (record["route"] or {}).get("matched_blocks", 0) == 0


@pytest.mark.parametrize(("model", "timed"), [("llm", True), ("llm_ensemble", False)])
def test_only_a_model_with_its_own_cache_per_tenant_reports_time_to_first_token(stack, model, timed) -> None:
    # llm's engine takes the tenant's cache salt; the ensemble's path to it takes none, so there
    # the time to first token would tell whether another tenant sent the prompt's prefix.
    body = {"model": model, "inputs": {"text_input": "Hello there", "max_tokens": 2}}
    response = httpx.post(f"{stack.gateway_url}/infer", headers={**AUTH, "Prefer": "wait=60"}, json=body, timeout=90)
    record = response.json()
    assert record["status"] == "succeeded", record
    assert (record["timings"].get("ttft_ms") is not None) is timed, record["timings"]


# -- service tiers ------------------------------------------------------------------------


def test_flex_requests_run_below_interactive_ones(stack) -> None:
    key = _tenant(stack, "flex", limits={"max_concurrent": 1})
    tenant = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0, timeout=60)

    def start(tier: str, tokens: int):
        return tenant.responses.create(
            model="llm_synthetic", input="Go on", background=True, max_output_tokens=tokens, service_tier=tier
        )

    blocker = start("default", 200)  # ~4 s at 20 ms a token: the others queue behind it
    _until(lambda: tenant.responses.retrieve(blocker.id).status == "in_progress", what="blocker running")
    flex = [start("flex", 3) for _ in range(2)]
    interactive = [start("auto", 3) for _ in range(2)]
    assert all(tenant.responses.retrieve(r.id).status == "queued" for r in flex + interactive)
    ids = [r.id.removeprefix("resp_") for r in flex + interactive]
    _until(lambda: all(_record(stack, rid, key)["status"] == "succeeded" for rid in ids), what="all done")
    started = {rid: _record(stack, rid, key)["started_at"] for rid in ids}
    assert max(started[r.id.removeprefix("resp_")] for r in interactive) < min(
        started[r.id.removeprefix("resp_")] for r in flex
    )
    assert tenant.responses.retrieve(flex[0].id).service_tier == "flex"


def test_the_service_tier_that_ran_is_echoed(client) -> None:
    priority = client.chat.completions.create(model="llm_echo", messages=QUESTION, service_tier="priority")
    auto = client.chat.completions.create(model="llm_echo", messages=QUESTION, service_tier="auto")
    assert (priority.service_tier, auto.service_tier) == ("priority", "default")


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"some_future_field": {"nested": True}}, "some_future_field"),
        ({"service_tier": "scale"}, "service_tier"),
        ({"messages": [{"role": "user", "content": "hi", "name": "ann"}]}, "messages[0].name"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages[0].content[0].image_url",
        ),
    ],
)
def test_an_unsupported_field_is_refused_naming_it(client, extra, param) -> None:
    messages = extra.get("messages", QUESTION)
    others = {k: v for k, v in extra.items() if k != "messages"}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="llm", messages=messages, max_tokens=2, extra_body=others)
    assert caught.value.status_code == 400 and caught.value.code == "unsupported_parameter"
    assert caught.value.body["param"] == param


def test_neutral_values_of_unsupported_fields_ask_for_nothing(client) -> None:
    completion = client.chat.completions.create(
        model="llm", messages=QUESTION, max_tokens=2, extra_body={"logit_bias": {}, "store": False, "audio": None}
    )
    assert completion.choices[0].message.role == "assistant"


# -- prompt_cache_key ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def two_replicas(stack):
    second, second_url = stack.start_triton("triton-cache-key")
    env = {"REDIS_URL": stack.redis_db_url(61), **stack.replicas_env(stack.triton_grpc, second_url)}
    gateway, url = stack.start_gateway("gateway-cache-key", **env)
    yield url
    stack.stop(gateway)
    stack.stop(second)


def test_requests_with_one_prompt_cache_key_prefer_one_replica(stack, two_replicas) -> None:
    routed = openai.OpenAI(base_url=f"{two_replicas}/v1", api_key=stack.api_key, max_retries=0, timeout=60)
    healthy = "gateway_replica_healthy{"

    def both_ready() -> bool:
        lines = [line for line in httpx.get(f"{two_replicas}/metrics").text.splitlines() if line.startswith(healthy)]
        return len(lines) == 2 and all(line.endswith(" 1.0") for line in lines)

    _until(both_ready, timeout=120, what="both replicas healthy")
    records = []
    for i in range(6):  # different short prompts: no shared prefix block to route by
        raw = routed.chat.completions.with_raw_response.create(
            model="llm_synthetic",
            messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=2,
            prompt_cache_key="session-42",
        )
        records.append(_record(stack, raw.headers["x-request-id"], gateway=two_replicas))
    assert len({r["replica"] for r in records}) == 1
    assert all(r["route"]["reason"] == "cache_key" for r in records[1:])


# -- webhooks -----------------------------------------------------------------------------


@dataclass
class Receiver:
    """Records every POST; answers 200."""

    port: int = 0
    calls: list[tuple[dict[str, str], bytes]] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.calls.append(({k.decode(): v.decode() for k, v in scope["headers"]}, body))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    def events(self, kind: str) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for h, b in self.calls if json.loads(b).get("type") == kind]


@pytest_asyncio.fixture
async def receiver() -> AsyncIterator[Receiver]:
    app = Receiver(port=free_port())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=app.port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    yield app
    server.should_exit = True
    await task


SECRET = "whsec_" + "QmFzZTY0U2VjcmV0Rm9yT3BlbkFJRXZlbnRzMDE="


async def _wait_for(receiver: Receiver, kind: str, timeout: float = 60) -> tuple[dict[str, str], bytes]:
    deadline = time.monotonic() + timeout
    while not receiver.events(kind):
        assert time.monotonic() < deadline, f"no {kind} webhook"
        await asyncio.sleep(0.1)
    return receiver.events(kind)[0]


async def test_a_background_response_sends_a_signed_response_completed_webhook(stack, receiver) -> None:
    key = _tenant(stack, "hooks", webhook_secrets=[SECRET], openai_webhook_url=f"http://127.0.0.1:{receiver.port}/oai")
    async with openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0) as tenant:
        response = await tenant.responses.create(
            model="llm_echo", input="Tell me when done", background=True, max_output_tokens=200
        )
        headers, body = await _wait_for(receiver, "response.completed")
        event = Webhook(SECRET).verify(body, headers)  # Standard Webhooks: raises if the signature is wrong
        assert event["object"] == "event" and event["id"].startswith("evt_")
        assert event["data"] == {"id": response.id} and isinstance(event["created_at"], int)
        assert headers["webhook-id"].startswith("wh_")
        unwrapped = tenant.webhooks.unwrap(body.decode(), headers, secret=SECRET)  # OpenAI's own SDK reads it
        assert unwrapped.type == "response.completed" and unwrapped.data.id == response.id
        assert (await tenant.responses.retrieve(response.id)).status == "completed"


async def test_a_batch_that_ends_sends_a_signed_batch_completed_webhook(stack, receiver) -> None:
    key = _tenant(
        stack, "batchhooks", webhook_secrets=[SECRET], openai_webhook_url=f"http://127.0.0.1:{receiver.port}/b"
    )
    async with openai.AsyncOpenAI(base_url=f"{stack.gateway_url}/v1", api_key=key, max_retries=0) as tenant:
        line = {
            "custom_id": "one",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "text_embed", "input": "a"},
        }
        upload = await tenant.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
        batch = await tenant.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
        headers, body = await _wait_for(receiver, "batch.completed", timeout=120)
        event = Webhook(SECRET).verify(body, headers)
        assert event["data"] == {"id": batch.id}
        assert (await tenant.batches.retrieve(batch.id)).status == "completed"
