"""Conversations and response chains bounded and paged (gateway/server/openai/responses/conversations.py,
responses/store.py, responses/chains.py): caps on a conversation's items and bytes refused by name,
adding items counted in the tenant's requests per minute, TTL indexes, pages read from
MongoDB by position (a page of one item of a full conversation reads one item's bytes),
items found by id, responses that expired no longer in their conversation, and a
previous_response_id chain bounded in responses and bytes.

The caps are small on a gateway of their own (CAPS); the rest runs on the stack's."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any, cast

import bson
import httpx
import pytest
from pymongo import AsyncMongoClient, monitoring

from gateway.common.result_store import ResultStore
from gateway.server.openai.responses.chains import conversation_page
from gateway.server.openai.responses.store import CONVERSATIONS, ENTRIES, ConversationStore, item_entry
from gateway.server.services import Services
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.caller import Caller
from tests.conftest import AUTH
from tests.test_tenants import new_key, set_tenant

CAPS = {
    "CONVERSATION_MAX_ITEMS": "6",
    "CONVERSATION_MAX_BYTES": "6000",
    "RESPONSE_CHAIN_MAX": "2",
    "RESPONSE_CHAIN_MAX_BYTES": "4000",
}
WORDS = "the quick brown fox jumps over the lazy dog while seven wizards quietly hum "


def _text(size: int) -> str:
    return (WORDS * (size // len(WORDS) + 1))[:size]


def _message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": text}


def _database(stack) -> str:
    return stack.launcher.service_env.get("MONGO_DB") or os.environ.get("MONGO_DB") or "triton_gateway"


@pytest.fixture(scope="module")
def capped(stack) -> Iterator[str]:
    gateway, url = stack.start_gateway("gateway-conversation-caps", **CAPS)
    yield url
    stack.stop(gateway)


def _client(url: str, headers: dict[str, str] | Any = AUTH) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/v1", headers=dict(headers), timeout=120)


def _conversation(http: httpx.Client, items: list[dict[str, Any]] | None = None) -> str:
    created = http.post("/conversations", json={"items": items} if items else {})
    assert created.status_code == 200, created.text
    return str(created.json()["id"])


def _all_items(http: httpx.Client, conversation: str, order: str = "asc") -> list[dict[str, Any]]:
    listed = http.get(f"/conversations/{conversation}/items", params={"order": order, "limit": 100})
    assert listed.status_code == 200, listed.text
    return list(listed.json()["data"])


# -- caps -----------------------------------------------------------------------------------------


def test_a_conversation_over_its_item_limit_is_refused_by_name(capped: str) -> None:
    with _client(capped) as http:
        conversation = _conversation(http, [_message(f"item {n}") for n in range(6)])
        refused = http.post(f"/conversations/{conversation}/items", json={"items": [_message("one too many")]})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "conversation_items_limit" and "CONVERSATION_MAX_ITEMS" in error["message"]
        assert len(_all_items(http, conversation)) == 6  # nothing of the refused call was kept
        # An item deleted makes room for one.
        first = _all_items(http, conversation)[0]["id"]
        assert http.delete(f"/conversations/{conversation}/items/{first}").status_code == 200
        again = http.post(f"/conversations/{conversation}/items", json={"items": [_message("now it fits")]})
        assert again.status_code == 200, again.text


def test_a_conversation_over_its_byte_limit_is_refused_by_name(capped: str) -> None:
    with _client(capped) as http:
        conversation = _conversation(http, [_message(_text(5_000))])
        refused = http.post(f"/conversations/{conversation}/items", json={"items": [_message(_text(1_500))]})
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "conversation_bytes_limit"
        assert "CONVERSATION_MAX_BYTES" in refused.json()["error"]["message"]
        small = http.post(f"/conversations/{conversation}/items", json={"items": [_message("short")]})
        assert small.status_code == 200, small.text


def test_a_response_whose_conversation_with_outputs_passes_the_byte_limit_is_refused(capped: str) -> None:
    with _client(capped) as http:
        conversation = _conversation(http, [_message(_text(4_500))])
        first = http.post(
            "/responses",
            json={"model": "llm_echo", "input": "Repeat it.", "conversation": conversation, "max_output_tokens": 1500},
        )
        assert first.status_code == 200, first.text
        output = first.json()["output"][0]["content"][0]["text"]
        assert len(output.encode()) > 1_600  # (the echo of the prompt: with it the items pass 6,000 bytes)
        refused = http.post("/responses", json={"model": "llm_echo", "input": "Again.", "conversation": conversation})
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert (error["code"], error["param"]) == ("conversation_bytes_limit", "conversation")


# -- chains ---------------------------------------------------------------------------------------


def _respond(http: httpx.Client, text: str, previous: str | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "llm_echo", "input": text, "max_output_tokens": 8, **extra}
    if previous:
        body["previous_response_id"] = previous
    return http.post("/responses", json=body)


def test_a_chain_longer_than_its_limit_is_refused_by_name(capped: str) -> None:
    with _client(capped) as http:
        previous = None
        for turn in range(3):  # a chain of two before the third
            answer = _respond(http, f"turn {turn}", previous)
            assert answer.status_code == 200, answer.text
            previous = answer.json()["id"]
        refused = _respond(http, "turn 3", previous)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "response_chain_too_long" and error["param"] == "previous_response_id"
        assert "RESPONSE_CHAIN_MAX" in error["message"]


def test_a_chain_with_more_bytes_than_its_limit_is_refused_by_name(capped: str) -> None:
    with _client(capped) as http:
        first = _respond(http, _text(1_500))
        assert first.status_code == 200, first.text
        second = _respond(http, _text(3_000), first.json()["id"])
        assert second.status_code == 200, second.text  # the chain before it: 1,500 bytes and an output
        refused = _respond(http, "and then?", second.json()["id"])
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "response_chain_too_large" and error["param"] == "previous_response_id"
        assert "RESPONSE_CHAIN_MAX_BYTES" in error["message"]


# -- quotas, lifetime, indexes --------------------------------------------------------------------


async def test_adding_items_counts_against_the_tenants_requests_per_minute(stack) -> None:
    tenant = f"conv-rpm-{secrets.token_hex(4)}"
    # 3: the create is one request too (tests/test_conversation_caps.py), each add another.
    await set_tenant(stack, tenant, limits={"requests_per_minute": 3})
    key = await new_key(stack, tenant)
    with _client(stack.gateway_url, {"Authorization": f"Bearer {key}"}) as http:
        conversation = _conversation(http)
        added = http.post(f"/conversations/{conversation}/items", json={"items": [_message("one")]})
        assert added.status_code == 200 and added.headers["x-ratelimit-remaining-requests"] == "1"
        assert http.post(f"/conversations/{conversation}/items", json={"items": [_message("two")]}).status_code == 200
        refused = http.post(f"/conversations/{conversation}/items", json={"items": [_message("three")]})
        assert refused.status_code == 429, refused.text
        assert len(_all_items(http, conversation)) == 2


async def test_conversations_and_their_items_expire_by_ttl_indexes_renewed_on_use(stack, mongo) -> None:
    with _client(stack.gateway_url) as http:
        conversation = _conversation(http, [_message("first")])
        database = mongo[_database(stack)]
        before = await database[CONVERSATIONS].find_one({"_id": conversation})
        entry = await database[ENTRIES].find_one({"conversation": conversation})
        assert before is not None and entry is not None and entry["expires_at"] is not None
        assert http.post(f"/conversations/{conversation}/items", json={"items": [_message("again")]}).status_code == 200
        after = await database[CONVERSATIONS].find_one({"_id": conversation})
        renewed = await database[ENTRIES].find_one({"_id": entry["_id"]})
    assert str(after["expires_at"]) > str(before["expires_at"])
    assert str(renewed["expires_at"]) > str(entry["expires_at"])
    for collection in (CONVERSATIONS, ENTRIES):
        indexes = (await database[collection].index_information()).values()
        assert any(i["key"] == [("expires_at", 1)] and i.get("expireAfterSeconds") == 0 for i in indexes)
    keys = [i["key"] for i in (await database[ENTRIES].index_information()).values()]
    assert [("conversation", 1), ("position", 1)] in keys and [("conversation", 1), ("ids", 1)] in keys


async def test_items_of_a_response_that_expired_are_not_in_its_conversation(stack, mongo) -> None:
    with _client(stack.gateway_url) as http:
        conversation = _conversation(http, [_message("Kept item.")])
        made = http.post(
            "/responses",
            json={"model": "llm_echo", "input": "Short-lived.", "conversation": conversation, "max_output_tokens": 50},
        )
        assert made.status_code == 200, made.text
        given = _all_items(http, conversation)
        assert len(given) == 3
        # What the TTL monitor does once RESULT_RETENTION_S has passed: the response's document goes.
        await mongo[_database(stack)]["responses"].delete_one({"_id": made.json()["id"]})
        assert [item["id"] for item in _all_items(http, conversation)] == [given[0]["id"]]
        gone = http.get(f"/conversations/{conversation}/items/{given[1]['id']}")
        assert gone.status_code == 404
        then = http.post(
            "/responses",
            json={"model": "llm_echo", "input": "What now?", "conversation": conversation, "max_output_tokens": 200},
        )
        assert then.status_code == 200, then.text
        prompt = then.json()["output"][0]["content"][0]["text"]
        assert "Kept item." in prompt and "Short-lived." not in prompt


# -- pages and lookups ----------------------------------------------------------------------------


def test_pages_of_one_item_walk_a_conversation_in_both_orders(stack) -> None:
    with _client(stack.gateway_url) as http:
        conversation = _conversation(http, [_message(f"item {n}") for n in range(3)])
        made = http.post(
            "/responses",
            json={
                "model": "llm_echo",
                "input": [_message("in a"), _message("in b")],
                "conversation": conversation,
                "max_output_tokens": 20,
            },
        )
        assert made.status_code == 200, made.text
        http.post(f"/conversations/{conversation}/items", json={"items": [_message("last")]})
        for order in ("asc", "desc"):
            whole = [item["id"] for item in _all_items(http, conversation, order)]
            assert len(whole) == 7  # three added, the response's two inputs and its output, one more
            walked: list[str] = []
            after = None
            while True:
                params: dict[str, Any] = {"order": order, "limit": 1} | ({"after": after} if after else {})
                page = http.get(f"/conversations/{conversation}/items", params=params).json()
                walked += [item["id"] for item in page["data"]]
                assert page["has_more"] == (len(walked) < len(whole))
                if not page["has_more"]:
                    break
                after = page["last_id"]
            assert walked == whole
        unknown = http.get(f"/conversations/{conversation}/items", params={"after": "msg_unknown"})
        assert unknown.status_code == 400 and unknown.json()["error"]["param"] == "after"


def test_a_function_call_a_response_made_is_found_in_its_conversation_by_id(stack) -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
    with _client(stack.gateway_url) as http:
        conversation = _conversation(http)
        made = http.post(
            "/responses",
            json={
                "model": "llm_synthetic",
                "input": "Weather in Paris?",
                "conversation": conversation,
                "tools": [tool],
                "tool_choice": "required",
                "max_output_tokens": 60,
            },
        )
        assert made.status_code == 200, made.text
        call = next(item for item in made.json()["output"] if item["type"] == "function_call")
        found = http.get(f"/conversations/{conversation}/items/{call['id']}")
        assert found.status_code == 200, found.text
        assert (found.json()["type"], found.json()["call_id"]) == ("function_call", call["call_id"])
        assert http.delete(f"/conversations/{conversation}/items/{call['id']}").status_code == 200
        assert http.get(f"/conversations/{conversation}/items/{call['id']}").status_code == 404


class _Replies(monitoring.CommandListener):
    """The bytes of the replies to reads of the conversation entries."""

    def __init__(self) -> None:
        self.bytes = 0

    def started(self, event: monitoring.CommandStartedEvent) -> None:
        pass

    def succeeded(self, event: monitoring.CommandSucceededEvent) -> None:
        if event.command_name in ("find", "getMore", "aggregate"):
            self.bytes += len(bson.encode(event.reply))

    def failed(self, event: monitoring.CommandFailedEvent) -> None:
        pass


async def test_a_page_of_one_item_of_a_full_conversation_reads_one_items_bytes(stack) -> None:
    item_size, cap = 50_000, 40
    settings = GatewaySettings(conversation_max_items=cap, conversation_max_bytes=cap * (item_size + 200))
    replies = _Replies()
    client: AsyncMongoClient = AsyncMongoClient(stack.mongo_url, tz_aware=True, event_listeners=[replies])
    try:
        result_store = ResultStore(client, _database(stack), settings.result_retention_s)
        svc = cast(Services, SimpleNamespace(store=result_store, settings=settings))
        who = Caller(tenant=f"conv-bytes-{secrets.token_hex(4)}")
        store = ConversationStore(svc)
        conversation = (await store.create(who.scope, {}))["_id"]
        text = _text(item_size)
        items = [{"id": f"msg_{n:03d}", "type": "message", "role": "user", "content": text} for n in range(cap)]
        for start in range(0, cap, 10):
            await store.append(who.scope, conversation, [item_entry(item) for item in items[start : start + 10]])
        with pytest.raises(Exception) as over:  # at its cap
            await store.append(who.scope, conversation, [item_entry({"id": "msg_more", "content": "x"})])
        assert getattr(over.value, "code", None) == "conversation_items_limit"

        replies.bytes = 0
        page, more = await conversation_page(svc, who, conversation, limit=1, after=None, descending=True)
        assert ([item["id"] for item in page], more) == (["msg_039"], True)
        assert item_size < replies.bytes < 2 * item_size  # one item's bytes, not the conversation's 2 MB

        replies.bytes = 0
        page, more = await conversation_page(svc, who, conversation, limit=1, after="msg_039", descending=True)
        assert [item["id"] for item in page] == ["msg_038"] and more
        assert replies.bytes < 3 * item_size  # the entry named by `after`, then one more
        await store.delete(who.scope, conversation)
    finally:
        await client.close()
