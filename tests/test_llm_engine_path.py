"""The LLM engine path: the gateway tokenizes, calls the engine (TensorRT-LLM's contract)
with token ids, detokenizes incrementally, counts usage, cancels by cancelling the
stream; the engine stand-in reuses whole prompt blocks from its prefix KV cache."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from gateway.server.llm.blocks import block_keys, salt_id
from tests.gateway_calls import read_events, submit, wait_result

MODEL_REPO = Path(__file__).resolve().parents[1] / "model_repo"
SYSTEM = (
    "You are the gateway's assistant. You answer questions about serving models on Triton, "
    "about Redis streams, MongoDB records and vector search, briefly and plainly. " * 2
)


def _tokenizer(tiny_models) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_models["gpt2"] / "tokenizer.json"))


def _engine_metric(stack, name: str, model: str = "llm_engine", **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == name
                and sample.labels.get("model") == model
                and all(sample.labels.get(k) == v for k, v in labels.items())
            ):
                return sample.value
    raise AssertionError(f"{name} {labels} not reported for {model}")


async def _until(check, timeout: float = 10, interval: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(interval)


def test_the_gateway_and_the_engine_hash_prompt_blocks_alike() -> None:
    spec = importlib.util.spec_from_file_location(
        "kv_blocks", MODEL_REPO / "local" / "llm_engine" / "1" / "kv_blocks.py"
    )
    assert spec and spec.loader
    engine_side = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(engine_side)
    tokens = [random.Random(7).randrange(50_000) for _ in range(300)]
    assert block_keys(tokens, 32) == engine_side.block_keys(tokens, 32)
    assert len(block_keys(tokens, 32)) == 300 // 32
    # Salted (per tenant): the engine is sent the salt as TensorRT-LLM's cache_salt_id.
    assert block_keys(tokens, 32, "acme") == engine_side.block_keys(tokens, 32, salt_id("acme"))
    assert not set(block_keys(tokens, 32, "acme")) & set(block_keys(tokens, 32, "beta"))


async def test_streamed_text_of_any_unicode_joins_to_the_final_text(http) -> None:
    text = "Emoji 👋🏽 and 🇫🇷, CJK 世界你好, combining e\u0301 and n\u0303, Hindi नमस्ते, Ωμέγα."
    request_id = await submit(
        http, {"model": "llm_echo", "inputs": {"text_input": text, "max_tokens": 400}, "stream": True}
    )
    events = await read_events(http, request_id)
    record = json.loads(events[-1]["data"])
    tokens = [json.loads(e["data"]) for e in events if e["event"] == "token"]
    streamed = "".join(t["text_output"] for t in tokens)
    assert record["status"] == "succeeded"
    assert streamed == record["outputs"]["text_output"] == text  # the echo engine repeats the prompt
    assert "\ufffd" not in streamed
    assert len(tokens) >= 2


async def test_the_engine_path_and_the_ensemble_path_give_the_same_text_for_a_seed(http) -> None:
    body = {"inputs": {"text_input": "Once upon a time", "max_tokens": 24}, "parameters": {"seed": 11, "top_k": 20}}
    engine = await http.post("/infer", json={"model": "llm", **body}, headers={"Prefer": "wait=30"})
    ensemble = await http.post("/infer", json={"model": "llm_ensemble", **body}, headers={"Prefer": "wait=30"})
    assert engine.json()["status"] == ensemble.json()["status"] == "succeeded"
    assert engine.json()["outputs"]["text_output"] == ensemble.json()["outputs"]["text_output"]


async def test_usage_is_the_tokenizers_count(http, tiny_models) -> None:
    prompt = "Count these tokens: the gateway owns them."
    response = await http.post(
        "/infer",
        json={"model": "llm_echo", "inputs": {"text_input": prompt, "max_tokens": 200}},
        headers={"Prefer": "wait=30"},
    )
    record = response.json()
    expected = len(_tokenizer(tiny_models).encode(prompt).ids)
    # (A prompt shorter than one KV block has nothing to reuse from the prefix cache.)
    assert record["usage"] == {"prompt_tokens": expected, "completion_tokens": expected, "cached_tokens": 0}
    assert record["outputs"]["finish_reason"] == "stop"


async def test_max_tokens_reached_is_finish_reason_length(http) -> None:
    response = await http.post(
        "/infer",
        json={"model": "llm_echo", "inputs": {"text_input": "a b c d e f g h i j", "max_tokens": 3}},
        headers={"Prefer": "wait=30"},
    )
    record = response.json()
    assert record["usage"]["completion_tokens"] == 3
    assert record["outputs"]["finish_reason"] == "length"


async def test_chat_messages_are_rendered_with_the_models_chat_template(http) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    response = await http.post(
        "/infer",
        json={"model": "llm_echo", "inputs": {"messages": messages, "max_tokens": 200}},
        headers={"Prefer": "wait=30"},
    )
    expected = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    assert response.json()["outputs"]["text_output"] == expected


async def test_a_prompt_over_the_engine_limit_is_422_prompt_too_long_and_nothing_is_queued(http, stack) -> None:
    before = _accepted(await http.get("/metrics"))
    response = await http.post("/infer", json={"model": "llm", "inputs": {"text_input": "word " * 600}})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "prompt_too_long"
    assert error["details"]["prompt_tokens"] > error["details"]["max_input_tokens"]
    assert _accepted(await http.get("/metrics")) == before


async def test_a_huge_prompt_is_tokenized_while_the_gateway_serves_other_calls(http) -> None:
    # A conversation of ~1.3 MB (each message under the 100,000 characters a text may
    # have), of words the tokenizer has not seen together: a second or so to tokenize.
    # On llm_agent, whose 131k context is too large for the prompt's length alone to
    # refuse it (test_cheap_checks_first): it is tokenized, then refused.
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 9))) for _ in range(200_000)]
    messages = [{"role": "user", "content": " ".join(words[i : i + 15_000])} for i in range(0, len(words), 15_000)]
    payload = json.dumps({"model": "llm_agent", "inputs": {"messages": messages}}).encode()
    sent = asyncio.Event()

    async def body():
        yield payload
        sent.set()  # httpx asks for more once the whole body is written

    huge = asyncio.create_task(http.post("/infer", content=body(), headers={"Content-Type": "application/json"}))
    await sent.wait()
    # /healthz calls asked and answered while the huge prompt was in the gateway: a
    # tokenizer holding the event loop (or the interpreter's lock) answers none of them
    # until it is done. Counted, not timed.
    answered_meanwhile = 0
    while not huge.done():
        assert (await http.get("/healthz")).status_code == 200
        if not huge.done():
            answered_meanwhile += 1
        await asyncio.sleep(0.01)
    response = await huge
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "prompt_too_long"
    assert answered_meanwhile >= 10, f"{answered_meanwhile} calls answered while the prompt was tokenized"


def _accepted(response: httpx.Response) -> float:
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name == "gateway_requests_accepted_total" and sample.labels.get("model") == "llm":
                return sample.value
    return 0.0


async def test_cancel_on_the_engine_path_stops_generation_within_a_step(http, stack) -> None:
    # The synthetic engine (the same scheduler as llm_engine) makes 50 tokens/s, so 250
    # tokens would take 5 s: the cancel must end it within a step or two.
    def active() -> float:
        return _engine_metric(stack, "nv_trt_llm_request_metrics", model="llm_synthetic", request_type="active")

    body = {"model": "llm_synthetic", "inputs": {"text_input": "Go on", "max_tokens": 250}, "stream": True}
    request_id = await submit(http, body)
    events = await read_events(http, request_id, limit=5)  # queued, running, tokens
    assert events[-1]["event"] == "token"
    assert active() == 1
    response = await http.post(f"/results/{request_id}/cancel")
    assert response.status_code == 200, response.text
    await _until(lambda: active() == 0, timeout=0.5)
    record = await wait_result(http, request_id)
    assert record["status"] == "canceled"
    assert record["usage"]["completion_tokens"] < 50
    again = await http.post(
        "/infer",
        json={**body, "inputs": {"text_input": "again", "max_tokens": 4}, "stream": False},
        headers={"Prefer": "wait=30"},
    )
    assert again.json()["status"] == "succeeded"


async def test_a_second_request_with_the_same_prefix_prefills_only_its_suffix(http, stack, tiny_models) -> None:
    tokenizer = _tokenizer(tiny_models)
    first, second = SYSTEM + " First question?", SYSTEM + " Another, longer question about caches?"
    await http.post(
        "/infer", json={"model": "llm", "inputs": {"text_input": first, "max_tokens": 2}}, headers={"Prefer": "wait=30"}
    )
    reused = _engine_metric(stack, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused")
    prefilled = _engine_metric(stack, "llm_engine_prefilled_tokens")
    response = await http.post(
        "/infer",
        json={"model": "llm", "inputs": {"text_input": second, "max_tokens": 2}},
        headers={"Prefer": "wait=30"},
    )
    assert response.json()["status"] == "succeeded"
    ids_first, ids_second = tokenizer.encode(first).ids, tokenizer.encode(second).ids
    shared = next(i for i, (a, b) in enumerate(zip(ids_first, ids_second, strict=False)) if a != b)
    whole_blocks = min(shared, len(ids_second) - 1) // 32
    assert whole_blocks >= 2
    assert (
        _engine_metric(stack, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="reused") - reused
        == whole_blocks
    )
    assert _engine_metric(stack, "llm_engine_prefilled_tokens") - prefilled == len(ids_second) - whole_blocks * 32


async def test_the_ensemble_path_reports_usage_by_the_models_tokenizer(http, tiny_models) -> None:
    prompt = "Once upon a time there was"
    response = await http.post(
        "/infer",
        json={
            "model": "llm_ensemble",
            "inputs": {"text_input": prompt, "max_tokens": 5},
            "parameters": {"seed": 3, "top_k": 20},
        },
        headers={"Prefer": "wait=30"},
    )
    record = response.json()
    assert record["status"] == "succeeded", record
    assert record["usage"]["prompt_tokens"] == len(_tokenizer(tiny_models).encode(prompt).ids)
    assert 0 < record["usage"]["completion_tokens"] <= 5


async def test_a_streamed_ensemble_request_reports_usage_and_its_text(http) -> None:
    body = {
        "model": "llm_ensemble",
        "inputs": {"text_input": "Once upon a time", "max_tokens": 6},
        "parameters": {"seed": 5, "top_k": 20},
    }
    request_id = await submit(http, {**body, "stream": True})
    events = await read_events(http, request_id)
    record = json.loads(events[-1]["data"])
    streamed = "".join(json.loads(e["data"])["text_output"] for e in events if e["event"] == "token")
    assert record["status"] == "succeeded", record
    assert streamed == record["outputs"]["text_output"]
    assert 0 < record["usage"]["completion_tokens"] <= 6


async def test_the_ensemble_path_ends_length_when_max_tokens_is_reached(http) -> None:
    response = await http.post(
        "/infer",
        json={
            "model": "llm_ensemble",
            "inputs": {"text_input": "Once upon a time", "max_tokens": 4},
            "parameters": {"seed": 3, "top_k": 20},
        },
        headers={"Prefer": "wait=30"},
    )
    assert response.json()["outputs"]["finish_reason"] == "length"


async def test_a_stop_sequence_ends_the_ensembles_text_before_it(http) -> None:
    body = {"model": "llm_ensemble", "parameters": {"seed": 9, "top_k": 20}}
    inputs = {"text_input": "Once upon a time", "max_tokens": 24}
    whole = (await http.post("/infer", json={**body, "inputs": inputs}, headers={"Prefer": "wait=30"})).json()
    text = whole["outputs"]["text_output"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # three characters from its middle, across tokens maybe
    assert stop.strip(), text
    stopped = await http.post(
        "/infer", json={**body, "inputs": {**inputs, "stop_words": [stop]}}, headers={"Prefer": "wait=30"}
    )
    record = stopped.json()
    assert record["outputs"]["text_output"] == text[: text.index(stop)]
    assert record["outputs"]["finish_reason"] == "stop"
