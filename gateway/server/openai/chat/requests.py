"""A call's body as the ordinary requests behind it (native inputs and parameters, one
request per choice): OpenAI's sampling in the engines' terms, the choices' seeds, guided
decoding for a response format or a forced tool call. Also used by the Batch API and, for
the sampling, the Responses API."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.llm import tools as toolcalls
from gateway.server.models import ModelAdapter
from gateway.server.openai import common
from gateway.server.openai.chat.plan import chat_plan
from gateway.server.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseFormat,
    ResponseRequest,
    Sampling,
    refuse_unsupported,
    unsupported,
)
from gateway.server.services import Services

# Requests behind one call at most (n, times the prompts of a completion).
MAX_CHOICES = 16


def _guided(response_format: ResponseFormat | None, param: str = "response_format") -> dict[str, Any] | None:
    """TensorRT-LLM's guided decoding for a response format (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"guide_type": "json_schema", "guide": json.dumps({"type": "object"})}
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    if not schema:
        raise ApiError(400, "invalid_request", "json_schema needs a schema", details={"param": f"{param}.json_schema"})
    return {"guide_type": "json_schema", "guide": json.dumps(schema)}


_SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")


def parameters(body: Sampling | ResponseRequest, adapter: ModelAdapter, **extra: Any) -> dict[str, Any]:
    """The native parameters of a call; what the model's contract cannot take is refused by
    its OpenAI name."""
    found = {name: getattr(body, name, None) for name in _SAMPLING} | extra
    needs = {
        "presence_penalty": "penalties",
        "frequency_penalty": "penalties",
        "repetition_penalty": "repetition_penalty",
        "prompt_cache_key": "prompt_cache_key",
        "logprobs": "logprobs",
        "top_logprobs": "top_logprobs",
    }
    for name, feature in needs.items():
        if found.get(name) not in (None, False, 0):
            common.require(adapter, feature, name)
    found |= openai_sampling(found.get("temperature"), found.get("top_p"), found.get("top_k"))
    return {k: v for k, v in found.items() if v not in (None, False) and not (k == "top_logprobs" and v == 0)}


def openai_sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> dict[str, Any]:
    """OpenAI's sampling in the engines' terms. OpenAI samples unless told otherwise (an
    omitted temperature or top_p is 1); TensorRT-LLM's contracts search greedily unless a
    top_k above 1 or a top_p is given. So an omitted top_p is sent as 1 (the whole
    distribution: sampling at the temperature), and temperature 0 is sent as top_k 1
    (greedy on every engine, whatever it makes of a zero temperature)."""
    if temperature == 0:
        return {"temperature": None, "top_p": None, "top_k": 1}
    return {
        "temperature": 1.0 if temperature is None else temperature,
        "top_p": 1.0 if top_p is None else top_p,
        "top_k": top_k,
    }


def seeds(seed: int | None, count: int, key: str | None = None) -> list[int | None]:
    """One seed per choice: the call's seed + i, so n choices are n distinct draws and the
    same seed repeats. Without one, the first is derived from `key` (an Idempotency-Key, a
    batch line: the same call again is the same requests), or left to the submission, which
    gives each unseeded sampled request a fresh random seed."""
    if seed is None and key:
        seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4])
    if seed is None:
        return [None] * count
    return [(seed + i) % 2**63 for i in range(count)]


def chat_request(body: ChatCompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a chat completion, one per choice (also for the Batch API)."""
    adapter = common.llm(svc, body.model, chat=True)
    refuse_unsupported(body, "chat")
    body.check_stream_options()
    plan = chat_plan(body)
    inputs: dict[str, Any] = {
        "messages": common.messages(body.messages),
        "max_tokens": body.max_completion_tokens or body.max_tokens or common.DEFAULT_MAX_TOKENS,
        "stop_words": body.stop_words(),
    }
    if plan.tools:
        common.require(adapter, "tools", "tools")
        inputs["tools"] = plan.tools
    guided = _guided(body.response_format)
    if plan.forced:
        common.require(adapter, "guided_decoding", "tool_choice", "a forced tool call (tool_choice required or named)")
        if guided is not None:
            raise unsupported("response_format", "response_format cannot be combined with a forced tool call")
        schema = toolcalls.forced_call_schema(plan.tools or [])
        guided = {"guide_type": "json_schema", "guide": json.dumps(schema)}
    elif guided is not None:
        common.require(adapter, "guided_decoding", "response_format", f"response_format {body.response_format.type}")  # type: ignore[union-attr]
    if guided is not None:
        inputs["guided_decoding"] = guided
    count = body.choices
    if count > MAX_CHOICES:
        raise unsupported("n", f"n may be at most {MAX_CHOICES}")
    native = parameters(
        body,
        adapter,
        logprobs=plan.logprobs,
        top_logprobs=body.top_logprobs or 0,
        prompt_cache_key=body.prompt_cache_key,
    )
    labels = common.metadata(body, "chat.completions", plan.tier)
    return _choices(body, svc, inputs, native, labels, plan.tier, seeds(body.seed, count, seed_key))


def _choices(
    body: ChatCompletionRequest | CompletionRequest,
    svc: Services,
    inputs: dict[str, Any],
    native: dict[str, Any],
    labels: dict[str, str],
    run_as: common.Tier,
    choice_seeds: list[int | None],
) -> list[InferRequest]:
    """One ordinary request per choice, each with its own seed."""
    return [
        InferRequest(
            model=body.model,
            inputs=inputs,
            parameters=native | ({"seed": seed} if seed is not None else {}),
            stream=bool(body.stream),
            metadata=labels,
            priority=run_as.priority,
            timeout_s=common.timeout_for(svc, run_as),
        )
        for seed in choice_seeds
    ]


def completion_request(body: CompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a completion: n for each prompt."""
    adapter = common.llm(svc, body.model, chat=False)
    refuse_unsupported(body, "completions")
    body.check_stream_options()
    run_as = common.tier(body.service_tier)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ApiError(400, "invalid_request", "prompt must not be empty", details={"param": "prompt"})
    if len(prompts) * body.choices > MAX_CHOICES:
        raise unsupported("n", f"n times the prompts may be at most {MAX_CHOICES}")
    native = parameters(
        body,
        adapter,
        logprobs=body.logprobs is not None,
        top_logprobs=body.logprobs or 0,
    )
    labels = common.metadata(body, "completions", run_as)
    natives = []
    for number, prompt in enumerate(prompts):
        inputs = {"text_input": prompt, "max_tokens": body.max_tokens or 16, "stop_words": body.stop_words()}
        choice_seeds = seeds(body.seed, body.choices, seed_key and f"{seed_key}:{number}")
        natives += _choices(body, svc, inputs, native, labels, run_as, choice_seeds)
    return natives
