"""The completion objects, answered in one piece: a chat completion and a (legacy) text
completion from the records of their requests, one per choice."""

from __future__ import annotations

from typing import Any

from gateway.protocol import ResultRecord
from gateway.server.calls import run, terms
from gateway.server.calls.terms import read_calls
from gateway.server.llm import tools as toolcalls
from gateway.server.openai import common
from gateway.server.openai.chat.plan import chat_plan, tool_call
from gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest


def head(kind: str, request_id: str, created: int, model: str, tier: terms.Tier) -> dict[str, Any]:
    """The fields a completion object, or a streamed chunk, begins with (`kind` is its
    `object`); its id names the first request behind it."""
    return {
        "id": f"{'chatcmpl' if kind.startswith('chat.') else 'cmpl'}-{request_id}",
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "service_tier": tier.name,
    }


def chat_completion(
    records: list[ResultRecord],
    body: ChatCompletionRequest,
    tpb: int = 32,
    tool_format: toolcalls.ToolFormat | None = None,
) -> dict[str, Any]:
    plan = chat_plan(body, tool_format)
    choices = []
    for index, record in enumerate(records):
        text = (record.outputs or {}).get("text_output", "")
        content, calls = read_calls(text, plan)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        finish = run.finish_reason(record)
        if calls:
            message["tool_calls"] = [tool_call(record.request_id, i, call) for i, call in enumerate(calls)]
            finish = "tool_calls" if finish != "length" else finish  # a call cut by max_tokens says so
        logprobs = {"content": run.logprobs_of(record), "refusal": None} if plan.logprobs else None
        choices.append({"index": index, "message": message, "finish_reason": finish, "logprobs": logprobs})
    first = records[0]
    opening = head("chat.completion", first.request_id, common.created(first), body.model, plan.tier)
    return {**opening, "choices": choices, "usage": common.usage(records, tpb)}


def completion_logprobs(entries: list[dict[str, Any]], offset: int = 0) -> dict[str, Any]:
    """The legacy completions' logprobs object from OpenAI's chat-style entries."""
    tokens, offsets = [], []
    for entry in entries:
        offsets.append(offset)
        tokens.append(entry["token"])
        offset += len(entry["token"])
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{t["token"]: t["logprob"] for t in e.get("top_logprobs", [])} for e in entries],
        "text_offset": offsets,
    }


def text_completion(records: list[ResultRecord], body: CompletionRequest, tpb: int = 32) -> dict[str, Any]:
    choices = []
    for index, record in enumerate(records):
        text = (record.outputs or {}).get("text_output", "")
        logprobs = completion_logprobs(run.logprobs_of(record)) if body.logprobs is not None else None
        choices.append({"index": index, "text": text, "finish_reason": run.finish_reason(record), "logprobs": logprobs})
    first = records[0]
    opening = head(
        "text_completion", first.request_id, common.created(first), body.model, terms.tier(body.service_tier)
    )
    return {**opening, "choices": choices, "usage": common.usage(records, tpb)}
