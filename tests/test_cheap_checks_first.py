"""The cheap checks before the costly ones: a prompt far past the model's context is
refused from its length, never tokenized; a prompt refused as too long after tokenizing
counts as one of the tenant's requests, so a key over its rate cannot keep the
tokenizer busy for free."""

from __future__ import annotations

from tests.test_tenants import client_for, new_key, set_tenant

# Messages of 90,000 characters (a text may hold 100,000): far past any served context.
FAR_PAST = [{"role": "user", "content": "word " * 18_000} for _ in range(20)]


async def test_a_prompt_far_past_the_context_is_refused_by_its_length_before_tokenizing(http) -> None:
    response = await http.post("/infer", json={"model": "llm", "inputs": {"messages": FAR_PAST}})
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"
    # A floor from the characters, not a count: the tokenizer never ran.
    assert "at least" in error["message"]
    assert error["details"]["prompt_tokens"] > error["details"]["max_input_tokens"]


async def test_a_prompt_refused_as_too_long_counts_as_one_of_the_tenants_requests(stack) -> None:
    await set_tenant(stack, "tenant-long-prompts", limits={"requests_per_minute": 2})
    async with client_for(stack, await new_key(stack, "tenant-long-prompts")) as client:
        body = {"model": "llm", "inputs": {"text_input": "word " * 600}}
        for _ in range(2):
            refused = await client.post("/infer", json=body)
            assert refused.json()["error"]["code"] == "prompt_too_long"
        limited = await client.post("/infer", json=body)
    assert limited.status_code == 429, limited.text
    assert limited.json()["error"]["code"] == "rate_limited"
