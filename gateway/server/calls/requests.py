"""A call as the ordinary requests behind it: the model it names and what that model's
contract can do, then LlmCall (the call in the gateway's terms: messages or a prompt,
tools and how they are chosen, sampling, stops, an output shape, the tier) as one native
request per choice, with the choices' seeds."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from gateway.protocol.http import InferRequest
from gateway.server.api.errors import ApiError
from gateway.server.calls.terms import ChatPlan, Tier, unsupported
from gateway.server.llm import tools as toolcalls
from gateway.server.llm.tools import ToolFormat
from gateway.server.models import InvalidInput, ModelAdapter
from gateway.server.models.llm_engine import EngineLlmAdapter
from gateway.server.services import Services

# Default completion budget where the caller gives none (the engine caps it at its context).
DEFAULT_MAX_TOKENS = 512
# Requests behind one call at most (choices, times the prompts of a completion).
MAX_CHOICES = 16

# -- the model ------------------------------------------------------------------------------


def llm(svc: Services, model: str, *, chat: bool) -> ModelAdapter:
    try:
        adapter = svc.registry.get(model)
    except InvalidInput as exc:
        raise ApiError(404, "model_not_found", exc.message, details={"param": "model"}) from None
    if adapter.kind != "llm":
        raise ApiError(400, "invalid_model", f"{model} is not a text generation model", details={"param": "model"})
    if chat and not isinstance(adapter, EngineLlmAdapter):
        raise ApiError(
            400,
            "invalid_model",
            f"{model} takes text only (an ensemble); chat needs a model on its engine",
            details={"param": "model"},
        )
    return adapter


# An ensemble (tensorrtllm_backend's text ensemble) passes the sampling inputs it has on.
ENSEMBLE_FEATURES = frozenset({"repetition_penalty"})


def features(adapter: ModelAdapter) -> frozenset[str]:
    """What the model's contract can do beyond text (llm_engine.py, llm_llmapi.py)."""
    found = getattr(adapter, "features", None)
    return found if isinstance(found, frozenset) else ENSEMBLE_FEATURES


def require(adapter: ModelAdapter, feature: str, param: str, what: str | None = None) -> None:
    """Refuse `param` by name unless the model's contract has the feature."""
    if feature not in features(adapter):
        mode = getattr(getattr(adapter, "spec", None), "mode", "ensemble")
        raise unsupported(param, f"{what or param} is not supported by {adapter.name} (its {mode} contract)")


def tool_format(svc: Services, model: str) -> ToolFormat | None:
    """How the model writes tool calls (its chat template's family), where it is known."""
    tokenizer = getattr(svc.registry.adapters.get(model), "tokenizer", None)
    found = getattr(tokenizer, "tool_format", None)
    return found if isinstance(found, ToolFormat) else None


def context_length(svc: Services, model: str) -> int | None:
    """The model's context in tokens (prompt and answer together), where it is known."""
    found = getattr(svc.registry.adapters.get(model), "context_length", None)
    return found if isinstance(found, int) else None


def tokens_per_block(svc: Services, model: str) -> int:
    spec = svc.registry.specs.get(model)
    return spec.tokens_per_block if spec is not None else 32


def timeout_for(svc: Services, run_as: Tier) -> float | None:
    """Flex requests wait as long as any request may (a long deadline); others the default."""
    return svc.settings.max_timeout_s if run_as.flex else None


# -- sampling -------------------------------------------------------------------------------

SAMPLING = ("temperature", "top_p", "top_k", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_of(body: Any) -> dict[str, Any]:
    """The sampling fields of a body (SAMPLING, by their names; None where it has none)."""
    return {name: getattr(body, name, None) for name in SAMPLING}


def parameters(sampling: dict[str, Any], adapter: ModelAdapter, **extra: Any) -> dict[str, Any]:
    """The native parameters of a call, from its sampling (by the names of SAMPLING) and
    `extra`; what the model's contract cannot take is refused by its name."""
    found = {name: sampling.get(name) for name in SAMPLING} | extra
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
            require(adapter, feature, name)
    found |= openai_sampling(found.get("temperature"), found.get("top_p"), found.get("top_k"))
    return {k: v for k, v in found.items() if v not in (None, False) and not (k == "top_logprobs" and v == 0)}


def openai_sampling(temperature: float | None, top_p: float | None, top_k: int | None) -> dict[str, Any]:
    """OpenAI's sampling in the engines' terms (Anthropic's defaults are the same). OpenAI
    samples unless told otherwise (an omitted temperature or top_p is 1); TensorRT-LLM's
    contracts search greedily unless a top_k above 1 or a top_p is given. So an omitted
    top_p is sent as 1 (the whole distribution: sampling at the temperature), and
    temperature 0 is sent as top_k 1 (greedy on every engine, whatever it makes of a zero
    temperature)."""
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


def json_guide(schema: dict[str, Any]) -> dict[str, Any]:
    """TensorRT-LLM's guided decoding to a JSON schema."""
    return {"guide_type": "json_schema", "guide": json.dumps(schema)}


# -- a call ---------------------------------------------------------------------------------


@dataclass
class Output:
    """A shape asked of the output (guided decoding), with the field that asked, by the
    door's name, for a refusal: `param`, and `what` it asked for. `error`: why the shape
    cannot be made (a schema not given), raised once the model is known to make shapes."""

    guide: dict[str, Any] | None
    param: str
    what: str
    error: ApiError | None = None


@dataclass
class LlmCall:
    """A call in the gateway's terms. `messages` (the engine adapter's chat messages,
    terms.messages) or `prompt` (text completed as it is); `sampling` by the names of
    SAMPLING; `labels` its records' metadata."""

    model: str
    max_tokens: int
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    stop_words: list[str] | None = None
    plan: ChatPlan = field(default_factory=ChatPlan)
    output: Output | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    top_logprobs: int = 0
    prompt_cache_key: str | None = None
    seeds: list[int | None] = field(default_factory=lambda: [None])  # one a choice
    stream: bool = False
    labels: dict[str, str] = field(default_factory=dict)


def requests(call: LlmCall, adapter: ModelAdapter, svc: Services) -> list[InferRequest]:
    """The ordinary requests behind a call, one per seed (a choice each): its tools and
    output shape checked against the model's contract."""
    plan = call.plan
    inputs: dict[str, Any] = {"messages": call.messages} if call.messages is not None else {"text_input": call.prompt}
    inputs["max_tokens"] = call.max_tokens
    if call.stop_words is not None:
        inputs["stop_words"] = call.stop_words
    if plan.tools:
        require(adapter, "tools", "tools")
        inputs["tools"] = plan.tools
    guided = call.output.guide if call.output is not None else None
    if plan.forced:
        require(adapter, "guided_decoding", "tool_choice", "a forced tool call (tool_choice required or named)")
        if call.output is not None:
            raise unsupported(call.output.param, f"{call.output.param} cannot be combined with a forced tool call")
        guided = json_guide(toolcalls.forced_call_schema(plan.tools or []))
    elif call.output is not None:
        require(adapter, "guided_decoding", call.output.param, call.output.what)
        if call.output.error is not None:
            raise call.output.error
    if guided is not None:
        inputs["guided_decoding"] = guided
    if len(call.seeds) > MAX_CHOICES:
        raise unsupported("n", f"n may be at most {MAX_CHOICES}")
    native = parameters(
        call.sampling,
        adapter,
        logprobs=plan.logprobs,
        top_logprobs=call.top_logprobs,
        prompt_cache_key=call.prompt_cache_key,
    )
    return [
        InferRequest(
            model=call.model,
            inputs=inputs,
            parameters=native | ({"seed": seed} if seed is not None else {}),
            stream=call.stream,
            metadata=call.labels,
            priority=plan.tier.priority,
            timeout_s=timeout_for(svc, plan.tier),
        )
        for seed in call.seeds
    ]
