"""Guided decoding's budget, on the real stack: any grammar the gateway lets through (a guide
of at most 100,000 characters) compiles within the engine's limits or is refused with a 4xx,
and never takes the engine down with the other tenants' sequences in it."""

from __future__ import annotations

import httpx

from tests.conftest import AUTH
from tests.gateway_calls import submit, wait_result

MODEL = "llm_synthetic"  # seeded random logits under the guide: guided output is the grammar's


def _chain(rules: int) -> str:
    """A grammar of `rules` rules, each naming the next: about 24 characters a rule. Compiling
    it recurses once a rule; 3,000 overflowed the model's thread stack (a segfault)."""
    lines = [f'r{i} ::= "x{i}" r{(i + 1) % rules}?' for i in range(rules)]
    return "\n".join(["root ::= r0", *lines])


def _guided(guide_type: str, guide: str, max_tokens: int = 4) -> dict:
    inputs = {
        "text_input": "Go.",
        "max_tokens": max_tokens,
        "guided_decoding": {"guide_type": guide_type, "guide": guide},
    }
    return {"model": MODEL, "inputs": inputs}


async def test_a_grammar_of_thousands_of_chained_rules_compiles_and_is_followed(stack) -> None:
    guide = _chain(3_500)
    assert len(guide) < 100_000  # within what the gateway lets through
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=120) as client:
        record = await wait_result(client, await submit(client, _guided("ebnf_grammar", guide)), timeout=120)
        assert record["status"] == "succeeded", record
        assert record["outputs"]["text_output"].startswith("x0")
        after = await wait_result(client, await submit(client, _guided("json", "")))
    assert after["status"] == "succeeded", after  # the engine is still there


async def test_a_guide_that_does_not_compile_fails_its_request_by_name(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, headers=AUTH, timeout=120) as client:
        record = await wait_result(client, await submit(client, _guided("regex", "(unclosed")))
    assert record["status"] == "failed", record
    assert "guided_decoding_guide does not compile" in record["error"]["message"], record
