"""OpenAI's sampling, stop sequences and strict bodies, with the official `openai` package
against the real stack.

The LLM here is a tiny random GPT-2: sampled at temperature 1 its text differs from draw to
draw, and greedy it is always the same. The echo engine (llm_echo) generates its prompt's
tokens again, so what a stop sequence leaves of a known text can be checked exactly."""

from __future__ import annotations

import openai
import pytest

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ECHOED = "The capital of France is Paris. It lies on the Seine."


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def _chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model="llm", messages=QUESTION, max_tokens=12, **kwargs)


# -- sampling -------------------------------------------------------------------------------


def test_n_choices_at_temperature_1_are_distinct_draws(client) -> None:
    answer = _chat(client, n=3, temperature=1)
    texts = [choice.message.content for choice in answer.choices]
    assert len(set(texts)) == 3, texts


def test_an_omitted_temperature_samples_as_openai_does(client) -> None:
    texts = {_chat(client).choices[0].message.content for _ in range(3)}
    assert len(texts) > 1, texts


def test_unseeded_calls_differ(client) -> None:
    texts = {_chat(client, temperature=1).choices[0].message.content for _ in range(3)}
    assert len(texts) > 1, texts


def test_the_same_seed_repeats_the_same_text(client) -> None:
    first = _chat(client, temperature=1, seed=1234).choices[0].message.content
    second = _chat(client, temperature=1, seed=1234).choices[0].message.content
    assert first == second


def test_temperature_0_is_greedy(client) -> None:
    texts = {_chat(client, temperature=0).choices[0].message.content for _ in range(3)}
    greedy = _chat(client, temperature=0.01, top_p=0.0001).choices[0].message.content
    assert texts == {greedy}


def test_completions_sample_by_default_too(client) -> None:
    texts = {
        client.completions.create(model="llm", prompt="Once upon a time", max_tokens=12).choices[0].text
        for _ in range(3)
    }
    assert len(texts) > 1, texts


# -- stop sequences -------------------------------------------------------------------------


def test_a_stop_sequence_ends_the_text_before_it(client) -> None:
    answer = client.completions.create(model="llm_echo", prompt=ECHOED, max_tokens=100, stop=["Paris"])
    assert answer.choices[0].text == "The capital of France is "
    assert answer.choices[0].finish_reason == "stop"


def test_a_streamed_stop_sequence_is_never_sent(client) -> None:
    chunks = client.completions.create(model="llm_echo", prompt=ECHOED, max_tokens=100, stop=["Paris"], stream=True)
    pieces, finish = [], None
    for chunk in chunks:
        for choice in chunk.choices:
            pieces.append(choice.text)
            finish = choice.finish_reason or finish
    assert "".join(pieces) == "The capital of France is "
    assert finish == "stop"


def test_a_stop_sequence_across_token_boundaries_is_found(client) -> None:
    # "ital of Fr" spans several GPT-2 tokens and begins inside one ("capital").
    answer = client.completions.create(model="llm_echo", prompt=ECHOED, max_tokens=100, stop="ital of Fr")
    assert answer.choices[0].text == "The cap"
    assert answer.choices[0].finish_reason == "stop"


def test_a_stop_sequence_ends_a_chat_answer(client) -> None:
    messages = [{"role": "user", "content": ECHOED}]
    answer = client.chat.completions.create(model="llm_echo", messages=messages, max_tokens=200, stop=[". It"])
    content = answer.choices[0].message.content or ""
    assert content.endswith("The capital of France is Paris")
    assert answer.choices[0].finish_reason == "stop"


def test_a_text_without_its_stop_sequence_runs_to_its_end(client) -> None:
    answer = client.completions.create(model="llm_echo", prompt=ECHOED, max_tokens=100, stop=["London"])
    assert answer.choices[0].text == ECHOED
    assert answer.usage is not None and answer.usage.completion_tokens == answer.usage.prompt_tokens


# -- strict bodies --------------------------------------------------------------------------


def _refused(client: openai.OpenAI, param: str, **kwargs) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="llm", max_tokens=4, **kwargs)
    body = caught.value.body
    assert isinstance(body, dict) and body.get("param") == param, body


def test_a_user_message_without_content_is_refused(client) -> None:
    _refused(client, "messages[0].content", messages=[{"role": "user", "content": None}])


def test_a_text_part_without_text_is_refused(client) -> None:
    _refused(client, "messages[0].content[0].text", messages=[{"role": "user", "content": [{"type": "text"}]}])


def test_more_stop_sequences_than_allowed_are_refused(client) -> None:
    _refused(client, "stop", messages=QUESTION, stop=[f"s{i}" for i in range(17)])


def test_a_tool_message_without_its_call_id_is_refused(client) -> None:
    messages = [*QUESTION, {"role": "tool", "content": "21 C"}]
    _refused(client, "messages[1].tool_call_id", messages=messages)


def test_stream_options_without_stream_are_refused(client) -> None:
    _refused(client, "stream_options", messages=QUESTION, stream_options={"include_usage": True})


def test_sixteen_metadata_pairs_with_the_gateways_own_labels_are_accepted(client) -> None:
    metadata = {f"key{i}": f"value {i}" for i in range(16)}
    answer = _chat(client, metadata=metadata, user="someone", service_tier="flex", safety_identifier="s-1")
    assert answer.choices[0].message.content is not None
