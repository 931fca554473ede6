"""TensorRT-LLM's llmapi contract (text in, text out; the PyTorch backend): the local
stand-in llm_llmapi called on Triton directly, and the gateway's llmapi adapter in front of
it (the gateway still tokenizes, for admission, routing and usage)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from tritonclient.grpc import InferRequestedOutput

from gateway.server.models.base import tensor
from gateway.server.models.llm_llmapi import LlmapiRun
from gateway.server.models.registry import ModelSpec
from tests.gateway_calls import read_events, submit, wait_result
from tests.triton_requests import once

PROMPT = "Hello world, the gateway"


def _body(prompt: str, max_tokens: int, model: str = "llm_llmapi", **inputs: Any) -> dict[str, Any]:
    return {"model": model, "inputs": {"text_input": prompt, "max_tokens": max_tokens, **inputs}}


async def _run(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    return await wait_result(http, await submit(http, body))


def _metric(stack, name: str, model: str = "llm_llmapi") -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (name, f"{name}_total") and sample.labels.get("model") == model:
                return sample.value
    raise AssertionError(f"{name} not reported for {model}")


async def _until(check, timeout: float = 30, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


def _llmapi_request(prompt: str, max_tokens: int, *, streaming: bool, **extra: Any) -> dict[str, Any]:
    """A request as a client of TensorRT-LLM's llmapi model sends it: 1-D tensors."""

    def vector(name: str, values: list[Any], dtype: Any, datatype: str) -> Any:
        return tensor(name, np.array(values, dtype=dtype), datatype)

    inputs = [
        vector("text_input", [prompt.encode()], np.object_, "BYTES"),
        vector("sampling_param_max_tokens", [max_tokens], np.int32, "INT32"),
        vector("streaming", [streaming], np.bool_, "BOOL"),
        vector("return_finish_reason", [True], np.bool_, "BOOL"),
        vector("return_stop_reason", [True], np.bool_, "BOOL"),
    ]
    if "exclude_input_from_output" in extra:
        flag = extra["exclude_input_from_output"]
        inputs.append(vector("sampling_param_exclude_input_from_output", [flag], np.bool_, "BOOL"))
    return {
        "model_name": "llm_llmapi",
        "inputs": inputs,
        "outputs": [InferRequestedOutput(n) for n in ("text_output", "finish_reason", "stop_reason")],
        "request_id": f"llmapi-{uuid.uuid4().hex}",
    }


async def _responses(triton, request: dict[str, Any]) -> list[dict[str, str]]:
    out = []
    async for result, error in triton.stream_infer(once(request)):
        if error is not None:
            raise error
        out.append(
            {n: result.as_numpy(n).reshape(-1)[0].decode() for n in ("text_output", "finish_reason", "stop_reason")}
        )
    return out


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]):
    """Greedy generation with transformers on the same weights: the tokens llm_llmapi makes."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()

    def generate(prompt: str, max_tokens: int) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        tokens = out[0, ids.shape[1] :].tolist()
        return tokens[: tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens

    return tokenizer, generate


# -- the stand-in, called as TensorRT-LLM's llmapi model is -------------------------------------


async def test_streamed_responses_each_hold_the_text_so_far(triton) -> None:
    responses = await _responses(triton, _llmapi_request(PROMPT, 16, streaming=True, exclude_input_from_output=True))
    texts = [r["text_output"] for r in responses]
    assert len(texts) >= 2
    assert all(later.startswith(earlier) for earlier, later in itertools.pairwise(texts))
    assert [r["finish_reason"] for r in responses[:-1]] == ["None"] * (len(responses) - 1)
    assert responses[-1]["finish_reason"] in ("stop", "length")


async def test_the_text_begins_with_the_prompt_unless_excluded(triton) -> None:
    whole = await _responses(triton, _llmapi_request(PROMPT, 8, streaming=False))
    excluded = await _responses(triton, _llmapi_request(PROMPT, 8, streaming=False, exclude_input_from_output=True))
    assert len(whole) == len(excluded) == 1
    assert whole[0]["text_output"] == PROMPT + excluded[0]["text_output"]


# -- through the gateway ---------------------------------------------------------------------------


async def test_streamed_pieces_join_to_the_final_text(http) -> None:
    request_id = await submit(http, {**_body(PROMPT, 40), "stream": True})
    record = await wait_result(http, request_id)
    assert record["status"] == "succeeded"
    events = await read_events(http, request_id)
    pieces = [json.loads(e["data"])["text_output"] for e in events if e["event"] == "token"]
    assert len(pieces) >= 2
    assert "".join(pieces) == record["outputs"]["text_output"] != ""


async def test_the_same_greedy_seeded_prompt_gives_the_engine_path_s_text(http) -> None:
    parameters = {"seed": 7}
    engine = await _run(http, {**_body(PROMPT, 24, model="llm"), "parameters": parameters})
    llmapi = await _run(http, {**_body(PROMPT, 24), "parameters": parameters})
    assert engine["status"] == llmapi["status"] == "succeeded"
    assert llmapi["outputs"]["text_output"] == engine["outputs"]["text_output"] != ""


async def test_chat_messages_give_the_engine_path_s_text(http) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a bird."}]
    body = {"inputs": {"messages": messages, "max_tokens": 16}, "parameters": {"seed": 7}}
    engine = await _run(http, {"model": "llm", **body})
    llmapi = await _run(http, {"model": "llm_llmapi", **body})
    assert llmapi["outputs"]["text_output"] == engine["outputs"]["text_output"]
    assert llmapi["usage"]["prompt_tokens"] == engine["usage"]["prompt_tokens"]


async def test_a_stop_word_ends_the_text_before_it_with_finish_reason_stop(http, reference) -> None:
    tokenizer, generate = reference
    tokens = generate(PROMPT, 30)
    # A generated token that is its own tokenization, at its first occurrence: the stop word.
    candidates = [
        i
        for i, t in enumerate(tokens[:-1])
        if t not in tokens[:i] and tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    ]
    position = candidates[len(candidates) // 2]
    word = tokenizer.decode([tokens[position]])
    record = await _run(http, _body(PROMPT, 30, stop_words=[word]))
    assert record["outputs"]["finish_reason"] == "stop"
    assert record["outputs"]["stop_reason"] == word
    assert record["outputs"]["text_output"] == tokenizer.decode(tokens[:position], skip_special_tokens=True)


async def test_max_tokens_ends_it_with_finish_reason_length(http, reference) -> None:
    tokenizer, generate = reference
    tokens = generate(PROMPT, 12)
    assert len(tokens) == 12  # no end id within them
    record = await _run(http, _body(PROMPT, 12))
    assert record["outputs"]["finish_reason"] == "length"
    assert record["outputs"]["text_output"] == tokenizer.decode(tokens, skip_special_tokens=True)


async def test_usage_counts_prompt_and_completion_tokens(http, tiny_models) -> None:
    counter = Tokenizer.from_file(str(tiny_models["gpt2"] / "tokenizer.json"))
    record = await _run(http, _body(PROMPT, 20))
    text = record["outputs"]["text_output"]
    assert record["usage"]["prompt_tokens"] == len(counter.encode(PROMPT).ids)
    assert record["usage"]["completion_tokens"] == len(counter.encode(text, add_special_tokens=False).ids) > 0


async def test_cancel_mid_stream_stops_the_generation_in_triton(http, stack) -> None:
    cancelled = _metric(stack, "llm_llmapi_cancelled_requests")
    generated = _metric(stack, "llm_llmapi_generated_tokens")
    # About 250 tokens of the tiny model: longer than the cancel takes to reach the engine.
    request_id = await submit(http, {**_body("Cancel me", 250), "stream": True})
    events = await read_events(http, request_id, limit=3)  # queued, running, the first tokens
    assert events[-1]["event"] == "token"
    response = await http.post(f"/results/{request_id}/cancel")
    assert response.status_code == 200, response.text
    # The stand-in counts a request its client cancelled when its engine ends it.
    await _until(lambda: _metric(stack, "llm_llmapi_cancelled_requests") == cancelled + 1)
    assert _metric(stack, "llm_llmapi_active_requests") == 0
    assert _metric(stack, "llm_llmapi_generated_tokens") - generated < 250
    record = await wait_result(http, request_id)
    assert record["status"] == "canceled"


def _accepted(metrics: httpx.Response) -> float:
    for family in text_string_to_metric_families(metrics.text):
        for sample in family.samples:
            if sample.name == "gateway_requests_accepted_total" and sample.labels.get("model") == "llm_llmapi":
                return sample.value
    return 0.0


async def test_a_prompt_over_the_context_is_refused_before_queueing(http) -> None:
    before = _accepted(await http.get("/metrics"))
    response = await http.post("/infer", json=_body("word " * 600, 4))
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"
    assert error["details"]["prompt_tokens"] > error["details"]["max_input_tokens"]
    assert _accepted(await http.get("/metrics")) == before


async def test_bad_words_are_refused_since_the_contract_has_no_such_input(http) -> None:
    response = await http.post("/infer", json=_body(PROMPT, 4, bad_words=["gateway"]))
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "invalid_inputs"
    assert "bad_words" in response.json()["error"]["message"]


# -- the registry and the deltas (no server) --------------------------------------------------------


def test_the_llmapi_mode_needs_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="llmapi mode needs a tokenizer"):
        ModelSpec.model_validate({"name": "llm", "kind": "llm", "mode": "llmapi", "triton_model": "tensorrt_llm"})


class _Result:
    """What tritonclient's InferResult offers the run: named string outputs."""

    def __init__(self, text: str) -> None:
        self.values = {"text_output": text, "finish_reason": "None", "stop_reason": "None"}

    def as_numpy(self, name: str) -> np.ndarray:
        return np.array([self.values[name].encode()], dtype=np.object_)


def _run_of(text_so_far: bool) -> LlmapiRun:
    adapter = SimpleNamespace(triton_model="llm_llmapi", text_so_far=text_so_far)
    return LlmapiRun(adapter, prepared=None)  # type: ignore[arg-type]


def _pieces(run: LlmapiRun, texts: list[str]) -> list[str]:
    pieces = [p for text in texts for p in run.take(_Result(text))]  # type: ignore[arg-type]
    return [p.text for p in pieces + run.flush()]


@pytest.mark.parametrize(
    ("text_so_far", "sent"),
    [(True, ["Pa", "Paris", "Paris is", "Paris is 😀"]), (False, ["Pa", "ris", " is", " 😀"])],
)
def test_either_kind_of_streamed_text_gives_exact_deltas(text_so_far: bool, sent: list[str]) -> None:
    run = _run_of(text_so_far)
    assert _pieces(run, sent) == ["Pa", "ris", " is", " 😀"]
    assert run.emitted == "Paris is 😀"


def test_an_unfinished_character_is_held_back_until_it_completes() -> None:
    assert _pieces(_run_of(True), ["Hi ", "Hi \ufffd", "Hi 😀"]) == ["Hi ", "😀"]
