"""Anthropic's Messages API with the official `anthropic` package, unmodified, against the
real stack: text (its rendered prompt, from the echo engine), streamed with Anthropic's
events, a tool round trip (a forced call, the tool's result, the answer; streamed and
not), stop sequences, count_tokens, x-api-key and anthropic-version, Anthropic's error
shapes, and the durable pipeline underneath (the record, Idempotency-Key, quotas).

The test stack's LLM is a tiny random model: its text is noise, so the tool call comes from
a forced tool choice (guided decoding), and text is checked on the echo engine."""

from __future__ import annotations

import json
import re
import time

import anthropic
import httpx
import openai
import pytest

from tests.conftest import AUTH

SYSTEM = "Be brief."
HELLO = [{"role": "user", "content": "Say hello."}]
# The echo engine answers with the prompt as the chat template rendered it.
RENDERED = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nSay hello.<|im_end|>\n<|im_start|>assistant\n"
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city now.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]
# Tools need a longer prompt than the tiny model's context: the synthetic engine (seeded
# random logits under the guide) serves them, as in tests/test_openai_features.py.
TOOLS_MODEL = "llm_synthetic"
FORCED = {"type": "tool", "name": "get_weather"}
# The `anthropic` package's create() has no sampling parameters any more; the API still takes
# them, as extra body fields.
GREEDY = {"temperature": 0}


@pytest.fixture
def client(stack) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=stack.api_key, max_retries=0, timeout=120)


def _record(stack, request_id: str) -> dict:
    url = f"{stack.gateway_url}/results/{request_id}"
    return httpx.get(url, headers=AUTH, params={"wait": 30}, timeout=60).json()


def _tenant_key(stack, name: str, **settings) -> str:
    tenant = f"{name}-{time.time_ns()}"
    created = httpx.post(f"{stack.gateway_url}/admin/keys", headers=AUTH, json={"tenant": tenant}, timeout=30)
    assert created.status_code == 201, created.text
    if settings:
        put = httpx.put(f"{stack.gateway_url}/admin/tenants/{tenant}", headers=AUTH, json=settings, timeout=30)
        assert put.status_code == 200, put.text
    return created.json()["key"]


# -- text -------------------------------------------------------------------------------------


def test_a_message_has_text_usage_and_a_durable_record(client, stack) -> None:
    raw = client.messages.with_raw_response.create(model="llm_echo", system=SYSTEM, messages=HELLO, max_tokens=200)
    message = raw.parse()
    assert message.type == "message" and message.role == "assistant" and message.model == "llm_echo"
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == RENDERED
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    assert prompt == message.usage.output_tokens > 0  # the echo engine returns the prompt's tokens
    request_id = raw.headers["request-id"]
    assert raw.headers["x-request-id"] == request_id and message.id == f"msg_{request_id}"
    record = _record(stack, request_id)
    assert record["status"] == "succeeded" and record["metadata"]["api"] == "messages"


def test_a_streamed_message_sends_anthropics_events_in_order(client) -> None:
    with client.messages.stream(model="llm_echo", system=SYSTEM, messages=HELLO, max_tokens=200) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta" and kinds[-3] == "content_block_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert final.content[0].text == RENDERED
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens + (final.usage.cache_read_input_tokens or 0) == final.usage.output_tokens > 0


def test_message_start_carries_the_prompts_tokens_as_count_tokens_counts_them(client) -> None:
    asked = {"model": "llm_echo", "system": SYSTEM, "messages": HELLO}
    counted = client.messages.count_tokens(**asked)
    with client.messages.stream(max_tokens=200, **asked) as stream:
        (start,) = [event for event in stream if event.type == "message_start"]
    assert counted.input_tokens > 0
    assert start.message.usage.input_tokens == counted.input_tokens
    assert start.message.usage.output_tokens == 0


def test_message_delta_usage_splits_the_same_prompt_tokens_by_the_prefix_cache(client) -> None:
    asked = {"model": "llm_echo", "system": SYSTEM, "messages": HELLO}
    counted = client.messages.count_tokens(**asked)
    with client.messages.stream(max_tokens=200, **asked) as stream:
        (delta,) = [event for event in stream if event.type == "message_delta"]
    usage = delta.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert usage.output_tokens == counted.input_tokens  # the echo engine returns the prompt's tokens


def test_a_streamed_message_has_a_ping_after_message_start(stack) -> None:
    body = {"model": "llm_echo", "messages": HELLO, "max_tokens": 20, "stream": True}
    headers = {"x-api-key": stack.api_key, "anthropic-version": "2023-06-01"}
    with httpx.stream("POST", f"{stack.gateway_url}/v1/messages", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200
        events = [line.removeprefix("event: ") for line in response.iter_lines() if line.startswith("event: ")]
    assert events[:2] == ["message_start", "ping"] and events[-1] == "message_stop"


def test_stop_sequences_end_the_text_with_stop_reason_stop_sequence(client) -> None:
    message = client.messages.create(
        model="llm_echo", system=SYSTEM, messages=HELLO, max_tokens=200, stop_sequences=["Say", "never there"]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "Say"
    assert message.content[0].text == RENDERED.split("Say")[0]


def test_max_tokens_ends_with_stop_reason_max_tokens(client) -> None:
    message = client.messages.create(model="llm_echo", messages=HELLO, max_tokens=3)
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_count_tokens_counts_the_prompt_as_the_message_reads_it(client) -> None:
    counted = client.messages.count_tokens(model="llm_echo", system=SYSTEM, messages=HELLO)
    message = client.messages.create(model="llm_echo", system=SYSTEM, messages=HELLO, max_tokens=200)
    assert counted.input_tokens == message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(model="llm_echo", messages=HELLO, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens  # the tools are in the prompt


# -- tools ------------------------------------------------------------------------------------


def _forced_call(client: anthropic.Anthropic):
    return client.messages.create(
        model=TOOLS_MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=FORCED, max_tokens=60, extra_body=GREEDY
    )


def _with_result(message) -> list[dict]:
    """The conversation after the call: the assistant's call and the tool's result."""
    (call,) = [block for block in message.content if block.type == "tool_use"]
    result = {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps({"temperature_c": 21})}
    return [
        *QUESTION,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in message.content]},
        {"role": "user", "content": [result]},
    ]


def test_a_tool_round_trip_calls_then_answers_from_the_result(client) -> None:
    message = _forced_call(client)
    assert message.stop_reason == "tool_use"
    (call,) = message.content
    assert call.type == "tool_use" and call.name == "get_weather" and call.id.startswith("toolu_")
    assert call.input["city"] in ("Paris", "London", "Tokyo")
    answer = client.messages.create(
        model=TOOLS_MODEL, messages=_with_result(message), tools=[WEATHER], max_tokens=8, extra_body=GREEDY
    )
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in answer.content] == ["text"]


def test_a_streamed_tool_round_trip_gives_the_same_call(client) -> None:
    expected = _forced_call(client).content[0]
    with client.messages.stream(
        model=TOOLS_MODEL, messages=QUESTION, tools=[WEATHER], tool_choice=FORCED, max_tokens=60, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for an input_json_delta
    assert final.stop_reason == "tool_use"
    (call,) = final.content
    assert call.type == "tool_use" and (call.name, call.input) == (expected.name, expected.input)
    with client.messages.stream(
        model=TOOLS_MODEL, messages=_with_result(final), tools=[WEATHER], max_tokens=8, extra_body=GREEDY
    ) as stream:
        answer = stream.get_final_message()
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"


def test_tools_calls_and_results_are_rendered_into_the_prompt(client) -> None:
    call = _forced_call(client)
    offered = client.messages.create(model="llm_echo", messages=QUESTION, tools=[WEATHER], max_tokens=400)
    assert "<tools>" in offered.content[0].text and "get_weather" in offered.content[0].text
    answered = client.messages.create(
        model="llm_echo",
        messages=_with_result(call),
        tools=[WEATHER],
        tool_choice={"type": "none"},
        max_tokens=400,
    )
    prompt = answered.content[0].text
    assert "<tools>" not in prompt  # tool_choice none: no tools offered
    assert "<tool_call>" in prompt and '<tool_response>\n{"temperature_c": 21}\n</tool_response>' in prompt


# -- headers, errors, the pipeline --------------------------------------------------------------


def test_a_call_without_a_valid_key_is_anthropics_authentication_error(stack) -> None:
    bad = anthropic.Anthropic(base_url=stack.gateway_url, api_key="not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        bad.messages.create(model="llm_echo", messages=HELLO, max_tokens=5)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"
    assert refused.value.body["error"]["code"] == "invalid_api_key"


def test_an_unknown_model_is_anthropics_not_found_error(client) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model="no-such-model", messages=HELLO, max_tokens=5)
    assert refused.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}, "clear_tool_uses_20250919"),
        ({"output_config": {"format": {"type": "json_schema", "schema": {}}}}, "output_config.format"),
        ({"thinking": {"type": "sometimes"}}, "thinking"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"messages": [*HELLO, {"role": "assistant", "content": "Hel"}]}, "prefill"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
        ({"tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice"),
        ({"temperature": 1.5}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"metadata": {"user_id": "u", "other": "x"}}, "metadata.other"),
        ({"container": "c-1"}, "container"),
    ],
)
def test_what_is_not_served_is_an_invalid_request_error_naming_it(stack, extra: dict, named: str) -> None:
    body = {"model": "llm_echo", "messages": HELLO, "max_tokens": 5, **extra}
    headers = {"x-api-key": stack.api_key, "anthropic-version": "2023-06-01"}
    response = httpx.post(f"{stack.gateway_url}/v1/messages", json=body, headers=headers, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert named in error["error"]["message"]


@pytest.mark.parametrize("version", ["1999-01-01", "2023-01-01", "latest"])
def test_an_anthropic_version_before_the_messages_api_or_not_a_date_is_refused(stack, version: str) -> None:
    headers = {"x-api-key": stack.api_key, "anthropic-version": version}
    body = {"model": "llm_echo", "messages": HELLO, "max_tokens": 5}
    response = httpx.post(f"{stack.gateway_url}/v1/messages", json=body, headers=headers, timeout=60)
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_anthropic_version"


def test_sampling_parameters_are_taken_and_temperature_0_is_greedy(client) -> None:
    sampled = {"temperature": 0, "top_p": 0.5, "top_k": 5}
    first = client.messages.create(model="llm", messages=HELLO, max_tokens=12, extra_body=sampled)
    again = client.messages.create(model="llm", messages=HELLO, max_tokens=12, extra_body=sampled)
    assert first.content == again.content and first.usage.output_tokens > 0


def test_the_same_idempotency_key_answers_with_the_same_message(client) -> None:
    key = {"Idempotency-Key": f"anthropic-{time.time_ns()}"}
    first = client.messages.create(model="llm_echo", messages=HELLO, max_tokens=20, extra_headers=key)
    again = client.messages.create(model="llm_echo", messages=HELLO, max_tokens=20, extra_headers=key)
    assert first.id == again.id and first.content == again.content


def test_a_tenant_over_its_requests_per_minute_gets_anthropics_rate_limit_error(stack) -> None:
    key = _tenant_key(stack, "anthropic-rpm", limits={"requests_per_minute": 1})
    limited = anthropic.Anthropic(base_url=stack.gateway_url, api_key=key, max_retries=0, timeout=60)
    limited.messages.create(model="llm_echo", messages=HELLO, max_tokens=5)
    with pytest.raises(anthropic.RateLimitError) as refused:
        limited.messages.create(model="llm_echo", messages=HELLO, max_tokens=5)
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert refused.value.body["error"]["code"] == "rate_limited"


def test_cache_control_is_accepted_and_asks_for_nothing(client) -> None:
    cached = {"type": "ephemeral"}
    message = client.messages.create(
        model="llm_echo",
        system=[{"type": "text", "text": SYSTEM, "cache_control": cached}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Say hello.", "cache_control": cached}]}],
        max_tokens=200,
        cache_control=cached,
    )
    assert message.content[0].text == RENDERED


def test_count_tokens_counts_against_the_tenants_requests_per_minute(stack) -> None:
    key = _tenant_key(stack, "anthropic-count-rpm", limits={"requests_per_minute": 1})
    limited = anthropic.Anthropic(base_url=stack.gateway_url, api_key=key, max_retries=0, timeout=60)
    assert limited.messages.count_tokens(model="llm_echo", messages=HELLO).input_tokens > 0
    with pytest.raises(anthropic.RateLimitError):  # counting runs the tokenizer: it is a request
        limited.messages.count_tokens(model="llm_echo", messages=HELLO)


# -- a client's optional asks: accepted, served without them, named in a Warning header --------------

# Claude Code 2.1.332's betas (../shared/agent-requests/claude-code-2.1.332-first-call.json).
CLAUDE_CODE_BETAS = (
    "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27,"
    "mid-conversation-tool-changes-2026-07-01,thinking-token-count-2026-05-13,advanced-tool-use-2025-11-20,"
    "effort-2025-11-24"
)
DEFERRED = {"name": "DeferredToolPlaceholder", "description": "Never call this.", "input_schema": {"type": "object"}}


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"thinking": {"type": "adaptive", "display": "omitted"}}, "thinking"),
        ({"output_config": {"effort": "high"}}, "output_config.effort"),
        ({"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}}, "context_management"),
        ({"speed": "fast"}, "speed"),
        ({"diagnostics": {"enabled": True}}, "diagnostics"),
        ({"tools": [{**WEATHER, "strict": True, "eager_input_streaming": True}]}, "tools.strict"),
        ({"tools": [WEATHER, {**DEFERRED, "defer_loading": True}]}, "tools.defer_loading"),
    ],
)
def test_an_optional_ask_is_served_without_it_and_named_in_a_warning(client, extra: dict, named: str) -> None:
    raw = client.messages.with_raw_response.create(
        model="llm_echo", system=SYSTEM, messages=HELLO, max_tokens=2000, extra_body=extra
    )
    message = raw.parse()
    assert [block.type for block in message.content] == ["text"]  # no thinking block
    assert message.stop_reason == "end_turn"
    assert raw.headers["warning"].startswith('299 - "accepted and not applied: ') and named in raw.headers["warning"]


def test_a_deferred_tool_is_not_offered_to_the_model(client) -> None:
    deferred = {**DEFERRED, "defer_loading": True}
    message = client.messages.create(
        model="llm_echo", messages=HELLO, tools=[WEATHER, deferred], max_tokens=2000, extra_body=GREEDY
    )
    prompt = message.content[0].text  # (the echo engine answers with the rendered prompt)
    assert "get_weather" in prompt and "DeferredToolPlaceholder" not in prompt


def test_claude_codes_betas_query_and_string_user_id_are_served(client) -> None:
    user_id = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "s" * 36})
    raw = client.messages.with_raw_response.create(
        model="llm_echo",
        system=SYSTEM,
        messages=HELLO,
        max_tokens=200,
        metadata={"user_id": user_id * 2},  # (longer than the chat path's user: kept by its digest)
        extra_headers={"anthropic-beta": CLAUDE_CODE_BETAS},
        extra_query={"beta": "true"},
    )
    assert raw.parse().content[0].text == RENDERED
    assert "warning" not in raw.headers  # (nothing here is left unapplied)


def test_a_system_message_among_the_messages_is_kept_in_place(client) -> None:
    messages = [*HELLO, {"role": "system", "content": [{"type": "text", "text": "Env: linux."}]}]
    message = client.messages.create(model="llm_echo", system=SYSTEM, messages=messages, max_tokens=200)
    assert message.content[0].text == RENDERED.replace(
        "<|im_start|>assistant", "<|im_start|>system\nEnv: linux.<|im_end|>\n<|im_start|>assistant"
    )


def test_a_thinking_block_given_back_is_left_out_of_the_prompt(client) -> None:
    thought = {"type": "thinking", "thinking": "Hmm.", "signature": "sig"}
    messages = [
        *HELLO,
        {"role": "assistant", "content": [thought, {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "Again."},
    ]
    message = client.messages.create(model="llm_echo", messages=messages, max_tokens=200)
    assert "Hmm." not in message.content[0].text and "Hello." in message.content[0].text


def _prompt_of_tokens(client, tokens: int) -> str:
    """A user message of about `tokens` tokens (measured with count_tokens)."""

    def count(words: int) -> int:
        return client.messages.count_tokens(
            model="llm_echo", messages=[{"role": "user", "content": "hello " * words}]
        ).input_tokens

    base, hundred = count(0), count(100)
    words = (tokens - base) * 100 // (hundred - base) + 1
    return "hello " * words


def test_max_tokens_over_the_models_room_is_served_up_to_it_with_model_context_window_exceeded(client) -> None:
    # The echo engine (8,192 tokens of context) says the prompt again: a prompt of more than
    # half the context fills it before the answer ends.
    prompt = _prompt_of_tokens(client, 4200)
    message = client.messages.create(model="llm_echo", messages=[{"role": "user", "content": prompt}], max_tokens=32000)
    assert message.stop_reason == "model_context_window_exceeded"
    usage = message.usage
    assert usage.input_tokens + (usage.cache_read_input_tokens or 0) + usage.output_tokens == 8192


def test_a_prompt_over_the_context_is_anthropics_prompt_is_too_long(client) -> None:
    prompt = _prompt_of_tokens(client, 8400)
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="llm_echo", messages=[{"role": "user", "content": prompt}], max_tokens=10)
    error = refused.value.body["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "prompt_too_long"
    assert re.match(r"prompt is too long: \d+ tokens > 8191 maximum", error["message"])


# The stand-in that calls the first tool it is offered (model_repo/local/llm_agent).
AGENT = "llm_agent"
TRIGGER = "[call the first tool]"


def test_the_tools_offered_may_change_mid_conversation(client) -> None:
    """Claude Code's mid-conversation tool changes: an earlier turn called a tool that is no
    longer offered; the conversation goes on with the tools of now."""
    messages = [
        {"role": "user", "content": TRIGGER},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "OldTool", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "done"}]},
    ]
    message = client.messages.create(model=AGENT, messages=messages, tools=[WEATHER], max_tokens=100)
    assert message.content[0].text == "The tool answered." and message.stop_reason == "end_turn"


def test_a_tool_description_of_claude_codes_length_is_taken(client) -> None:
    long = {**WEATHER, "description": "Say what the weather is. " * 1700}  # (~42k characters)
    message = client.messages.create(
        model=AGENT, messages=[{"role": "user", "content": TRIGGER}], tools=[long], max_tokens=100
    )
    assert [(block.type, block.name) for block in message.content] == [("tool_use", "get_weather")]
    assert message.stop_reason == "tool_use"


def test_a_model_says_its_context_to_anthropics_models_api(client) -> None:
    info = client.models.retrieve(AGENT)
    assert (info.id, info.type, info.display_name) == (AGENT, "model", AGENT)
    assert (info.max_input_tokens, info.max_tokens) == (131071, 4096)
    assert AGENT in {model.id for model in client.models.list()}


def test_a_model_says_its_context_window_to_openais_models_api(stack) -> None:
    models = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0)
    found = models.models.retrieve("llm_echo")
    assert found.model_extra is not None and found.model_extra["context_window"] == 8192
    assert found.model_extra["max_input_tokens"] == 8191


def test_a_streamed_message_the_context_cut_says_model_context_window_exceeded(client) -> None:
    prompt = _prompt_of_tokens(client, 4200)
    with client.messages.stream(
        model="llm_echo", messages=[{"role": "user", "content": prompt}], max_tokens=32000
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded"
