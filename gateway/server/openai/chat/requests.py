"""A chat completion's or a completion's body as the core's call (gateway.server.calls:
LlmCall, made into the ordinary requests behind it, one per choice): OpenAI's messages,
stops, response format and choices in the gateway's terms. Also used by the Batch API."""

from __future__ import annotations

from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.calls import requests as calls
from gateway.server.calls.requests import MAX_CHOICES, LlmCall, Output
from gateway.server.calls.terms import ChatPlan, messages, tier, unsupported
from gateway.server.openai import common
from gateway.server.openai.chat.plan import chat_plan
from gateway.server.openai.schemas import ChatCompletionRequest, CompletionRequest, ResponseFormat, refuse_unsupported
from gateway.server.services import Services


def _output(response_format: ResponseFormat | None) -> Output | None:
    """The output shape a response format asks for (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    what = f"response_format {response_format.type}"
    if response_format.type == "json_object":
        return Output(calls.json_guide({"type": "object"}), "response_format", what)
    schema = response_format.json_schema.schema_ if response_format.json_schema else None
    if not schema:
        raise ApiError(
            400, "invalid_request", "json_schema needs a schema", details={"param": "response_format.json_schema"}
        )
    return Output(calls.json_guide(schema), "response_format", what)


def chat_request(body: ChatCompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a chat completion, one per choice (also for the Batch API)."""
    adapter = calls.llm(svc, body.model, chat=True)
    refuse_unsupported(body, "chat")
    body.check_stream_options()
    plan = chat_plan(body)
    call = LlmCall(
        model=body.model,
        messages=messages(body.messages),
        max_tokens=body.max_completion_tokens or body.max_tokens or calls.DEFAULT_MAX_TOKENS,
        stop_words=body.stop_words(),
        plan=plan,
        output=_output(body.response_format),
        sampling=calls.sampling_of(body),
        top_logprobs=body.top_logprobs or 0,
        prompt_cache_key=body.prompt_cache_key,
        seeds=calls.seeds(body.seed, body.choices, seed_key),
        stream=bool(body.stream),
        labels=common.metadata(body, "chat.completions", plan.tier),
    )
    return calls.requests(call, adapter, svc)


def completion_request(body: CompletionRequest, svc: Services, seed_key: str | None = None) -> list[InferRequest]:
    """The ordinary requests behind a completion: n for each prompt."""
    adapter = calls.llm(svc, body.model, chat=False)
    refuse_unsupported(body, "completions")
    body.check_stream_options()
    run_as = tier(body.service_tier)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ApiError(400, "invalid_request", "prompt must not be empty", details={"param": "prompt"})
    if len(prompts) * body.choices > MAX_CHOICES:
        raise unsupported("n", f"n times the prompts may be at most {MAX_CHOICES}")
    plan = ChatPlan(logprobs=body.logprobs is not None, tier=run_as)
    labels = common.metadata(body, "completions", run_as)
    natives: list[InferRequest] = []
    for number, prompt in enumerate(prompts):
        call = LlmCall(
            model=body.model,
            prompt=prompt,
            max_tokens=body.max_tokens or 16,
            stop_words=body.stop_words(),
            plan=plan,
            sampling=calls.sampling_of(body),
            top_logprobs=body.logprobs or 0,
            seeds=calls.seeds(body.seed, body.choices, seed_key and f"{seed_key}:{number}"),
            stream=bool(body.stream),
            labels=labels,
        )
        natives += calls.requests(call, adapter, svc)
    return natives
