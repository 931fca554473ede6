"""POST /v1/responses/compact with the official `openai` client against the real stack: a
`response.compaction` object (the conversation's user messages, then one compaction item)
valid for the openai package and the Open Responses specification; the item given back as
input puts its summary before the model; kept per tenant; a compact without its model
refused."""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import CompactedResponse

from tests.conftest import AUTH
from tests.test_openai_responses import TOOLS_MODEL, _spec_validate

CONVERSATION: list[Any] = [
    {"type": "message", "role": "user", "content": "Remember the compaction code word: slate."},
    {"type": "message", "role": "assistant", "content": "OK."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Compress this conversation."}]},
]


@pytest.fixture
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=stack.api_key, max_retries=0, timeout=120)


def test_compact_answers_a_compaction_object_with_the_user_messages_and_a_summary_item(client) -> None:
    compacted = client.responses.compact(model=TOOLS_MODEL, input=CONVERSATION, prompt_cache_key="compact-test")
    assert isinstance(compacted, CompactedResponse) and compacted.object == "response.compaction"
    _spec_validate(compacted.model_dump(mode="json", exclude_none=True), "CompactResource")
    kinds = [(item.type, getattr(item, "role", None)) for item in compacted.output]
    assert kinds == [("message", "user"), ("message", "user"), ("compaction", None)]
    assert compacted.output[0].content[0].text == CONVERSATION[0]["content"]
    assert compacted.output[-1].encrypted_content and compacted.usage.output_tokens > 0


def test_a_compaction_item_given_back_puts_its_summary_before_the_model(client) -> None:
    # llm_echo answers with its prompt: the summary holds the conversation it was given.
    compacted = client.responses.compact(model="llm_echo", input=CONVERSATION)
    given = [item.model_dump(exclude_none=True) for item in compacted.output]
    echoed = client.responses.create(
        model="llm_echo", input=[*given, {"role": "user", "content": "Continue."}], max_output_tokens=1000
    )
    prompt = echoed.output_text
    assert "A summary of the conversation so far:" in prompt and "slate" in prompt
    # The compaction item is an input item of the response, as given.
    items = client.responses.input_items.list(echoed.id, order="asc").data
    assert [item.type for item in items][-2:] == ["compaction", "message"]


def test_compact_continues_a_chain_named_by_previous_response_id(client) -> None:
    first = client.responses.create(model="llm_echo", input="The password is basalt.", max_output_tokens=100)
    compacted = client.responses.compact(model="llm_echo", previous_response_id=first.id, input="Compact it.")
    users = [item for item in compacted.output if item.type == "message"]
    assert [u.content[0].text for u in users] == ["The password is basalt.", "Compact it."]


def test_another_tenants_compaction_item_is_refused(stack, client) -> None:
    compacted = client.responses.compact(model=TOOLS_MODEL, input=CONVERSATION)
    item = compacted.output[-1].model_dump(exclude_none=True)
    tenant = f"compact-other-{time.time_ns()}"
    created = httpx.post(f"{stack.gateway_url}/admin/keys", headers=AUTH, json={"tenant": tenant}, timeout=30)
    other = openai.OpenAI(base_url=f"{stack.gateway_url}/v1", api_key=created.json()["key"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        other.responses.create(model="llm", input=[item, {"role": "user", "content": "Hi"}], max_output_tokens=2)
    assert caught.value.code == "compaction_not_found"
    assert caught.value.body["param"] == "input[0].encrypted_content"


def test_compact_without_a_model_is_refused(client) -> None:
    answer = httpx.post(
        f"{client.base_url}responses/compact", headers=AUTH, json={"input": "Compact this."}, timeout=60
    )
    assert answer.status_code in (400, 422), answer.text
    assert answer.json()["error"]["param"] == "model"


def test_compact_without_a_conversation_is_refused(client) -> None:
    answer = httpx.post(f"{client.base_url}responses/compact", headers=AUTH, json={"model": "llm"}, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input"
