"""TensorRT-LLM's own Triton clients, unmodified, against the local stack's Triton: the CPU
stand-ins in model_repo/local speak TensorRT-LLM's contract.

- inflight_batcher_llm_client.py: token ids to the `tensorrt_llm` model (llm_engine, decoupled;
  llm_engine_nondecoupled for its calls without streaming, which use the ModelInfer RPC);
- end_to_end_grpc_client.py: text to the `ensemble` model (its --model-name takes no other name);
- llmapi_client.py: text to the llmapi `tensorrt_llm` model (llm_llmapi, decoupled;
  llm_llmapi_nondecoupled for its plain calls, ModelInfer).

Each test runs one client as a subprocess (the copies in tests/data/trtllm_clients, see the
README there) and checks its exit status and what it printed; where the client has its own
correctness check (--check-output, --check-outputs) it gets the model's greedy output,
computed here with transformers on the same weights."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from google.protobuf import text_format
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer
from tritonclient.grpc import model_config_pb2

from gateway.stack.triton import load_twins

CLIENTS = Path(__file__).resolve().parent / "data" / "trtllm_clients"
MODEL_REPO = Path(__file__).resolve().parents[1] / "model_repo" / "local"
PROMPT = "Born in north-east France, Soyer trained as a"  # (the clients' default text)
TIMEOUT_S = 240

pytestmark = pytest.mark.skipif(
    not all(
        (CLIENTS / name).exists()
        for name in ("inflight_batcher_llm_client.py", "end_to_end_grpc_client.py", "llmapi_client.py")
    ),
    reason="TensorRT-LLM's client copies are not in tests/data/trtllm_clients (see the README there)",
)


class Reference:
    """Greedy decoding with transformers on the local stack's LLM weights."""

    def __init__(self, model_dir: Path) -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.fast = Tokenizer.from_file(str(model_dir / "tokenizer.json"))  # (llm_llmapi's)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.eos = self.tokenizer.eos_token_id
        self.vocab = int(self.model.get_output_embeddings().weight.shape[0])

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def logits(self, ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([ids])).logits[0].float()
        return logits.clone()  # (a plain tensor: changed in place outside inference mode)

    def greedy(
        self, ids: list[int], count: int, *, banned: tuple[int, ...] = (), bias: dict[int, float] | None = None
    ) -> list[int]:
        """Up to `count` new tokens (the end id ends them, not kept), the whole sequence run
        again at each step."""
        out: list[int] = []
        for _ in range(count):
            step = self.logits(ids + out)[-1]
            for token, weight in (bias or {}).items():
                step[token] += weight
            step[list(banned)] = float("-inf")
            token = int(step.argmax())
            if token == self.eos:
                break
            out.append(token)
        return out

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def single_token_words(self, tokens: list[int]) -> list[int]:
        """Those of `tokens` that are their own text's whole tokenization."""
        return [
            t for t in dict.fromkeys(tokens) if self.tokenizer.encode(self.text([t]), add_special_tokens=False) == [t]
        ]


@pytest.fixture(scope="module")
def reference(tiny_models: dict[str, Path]) -> Reference:
    return Reference(tiny_models["gpt2"])


Run = Callable[..., subprocess.CompletedProcess]


@pytest.fixture(scope="module")
def client(stack, tiny_models: dict[str, Path]) -> Run:
    """Runs one of the clients against the stack's Triton: its output and exit status (the
    twins its calls without streaming use loaded first: the stack loads them when asked)."""
    load_twins(stack.triton_http, stack.data_dir / "model_repo_triton")

    def run(name: str, *args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, str(CLIENTS / name), "-u", stack.triton_grpc]
        if name == "inflight_batcher_llm_client.py":
            command += ["--tokenizer-dir", str(tiny_models["gpt2"])]
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        result = subprocess.run(
            [*command, *args], capture_output=True, text=True, timeout=TIMEOUT_S, env=env, check=False
        )
        result.stdout += result.stderr  # (one text to search; the clients print errors to both)
        return result

    return run


def inflight(client: Run, *args: str) -> subprocess.CompletedProcess:
    return client("inflight_batcher_llm_client.py", *args)


def end_to_end(client: Run, *args: str) -> subprocess.CompletedProcess:
    return client("end_to_end_grpc_client.py", *args)


def llmapi(client: Run, *args: str) -> subprocess.CompletedProcess:
    return client("llmapi_client.py", *args)


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-4000:]
    return result.stdout


def failed(result: subprocess.CompletedProcess) -> str:
    assert result.returncode != 0, result.stdout[-4000:]
    return result.stdout


def expected_csv(tmp_path: Path, ids: list[int]) -> str:
    """A file for the inflight client's --output-tokens-csv (its --check-output compares)."""
    path = tmp_path / "expected.csv"
    path.write_text(",".join(str(i) for i in ids) + "\n")
    return str(path)


def numbers(output: str, label: str) -> list[float]:
    """The numbers the client printed after `label` (a numpy array, maybe over lines)."""
    match = re.search(re.escape(label) + r"\s*(\[[^\]]*\]+)", output, re.DOTALL)
    assert match, f"{label!r} not in the output:\n{output[-3000:]}"
    return [float(x) for x in re.findall(r"-?\d+(?:\.\d*)?(?:e[-+]?\d+)?", match.group(1))]


def metrics(output: str) -> dict[str, float]:
    """The perf metrics the clients print as `name: value` lines."""
    names = (
        "kv_cache_alloc_new_blocks|kv_cache_reused_blocks|kv_cache_alloc_total_blocks|arrival_time_ns|"
        "first_scheduled_time_ns|first_token_time_ns|last_token_time_ns|acceptance_rate|"
        "total_accepted_draft_tokens|total_draft_tokens"
    )
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^({names}): (\S+)$", output, re.MULTILINE)}


def check_perf_metrics(found: dict[str, float], prompt_tokens: int) -> None:
    assert len(found) == 10, found
    blocks = math.ceil(prompt_tokens / 32)  # (tokens_per_block of the local configs)
    assert found["kv_cache_alloc_total_blocks"] == blocks
    assert found["kv_cache_reused_blocks"] + found["kv_cache_alloc_new_blocks"] == blocks
    arrival, scheduled = found["arrival_time_ns"], found["first_scheduled_time_ns"]
    assert 0 < arrival <= scheduled <= found["first_token_time_ns"] <= found["last_token_time_ns"]
    # No speculative decoding in the stand-in: no draft tokens, none accepted.
    assert (found["total_draft_tokens"], found["total_accepted_draft_tokens"], found["acceptance_rate"]) == (0, 0, 0)


# -- inflight_batcher_llm_client.py: token ids, the tensorrt_llm model ----------------------


def test_inflight_client_streams_the_models_greedy_tokens(client: Run, reference: Reference, tmp_path: Path) -> None:
    prompt = reference.ids(PROMPT)
    csv = expected_csv(tmp_path, prompt + reference.greedy(prompt, 16))
    output = ok(
        inflight(client, "--model-name", "llm_engine", "--streaming", "--check-output", "--output-tokens-csv", csv)
    )
    assert "PASS!" in output


def test_inflight_client_without_streaming_gets_the_prompt_and_its_tokens_from_the_non_decoupled_engine(
    client: Run, reference: Reference, tmp_path: Path
) -> None:
    # llm_engine_nondecoupled keeps TensorRT-LLM's default: output_ids begin with the prompt.
    prompt = reference.ids(PROMPT)
    tokens = reference.greedy(prompt, 16)
    csv = expected_csv(tmp_path, prompt + tokens)
    output = ok(
        inflight(client, "--model-name", "llm_engine_nondecoupled", "--check-output", "--output-tokens-csv", csv)
    )
    assert "PASS!" in output
    assert f"[[{len(prompt) + len(tokens)}]]" in output  # sequence_length: the prompt and the new tokens


def test_inflight_client_excluding_the_input_gets_the_new_tokens_only(
    client: Run, reference: Reference, tmp_path: Path
) -> None:
    prompt = reference.ids(PROMPT)
    csv = expected_csv(tmp_path, reference.greedy(prompt, 16))
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output")
    output = ok(inflight(client, *args, "--check-output", "--output-tokens-csv", csv))
    assert "PASS!" in output


def test_inflight_client_without_streaming_is_refused_by_the_decoupled_engine(client: Run) -> None:
    # As by TensorRT-LLM deployed with decoupled_mode true: Triton takes no ModelInfer RPC.
    output = failed(inflight(client, "--model-name", "llm_engine"))
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in output


def test_inflight_client_stop_request_ends_a_stream_early(client: Run) -> None:
    # The client itself checks that fewer than --request-output-len tokens came.
    args = ("--model-name", "llm_engine", "--streaming", "--request-output-len", "220", "--stop-after-ms", "60")
    output = ok(inflight(client, *args, "--request-id", "stop-stream-1"))
    assert "Got cancellation response from server" in output  # (the stop request's empty answer)


def test_inflight_client_request_cancel_ends_a_stream_early(client: Run) -> None:
    args = ("--model-name", "llm_engine", "--streaming", "--request-output-len", "220", "--stop-after-ms", "60")
    output = ok(inflight(client, *args, "--stop-via-request-cancel"))
    assert "Request is cancelled" in output


def test_inflight_client_stop_request_ends_a_request_without_streaming_early(client: Run) -> None:
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output", "--request-output-len", "220")
    output = ok(inflight(client, *args, "--stop-after-ms", "60", "--request-id", "stop-unary-1"))
    assert "Got cancellation response from server" in output
    assert output.count("Got completed request") == 2  # the request's tokens so far, and the stop's


def test_inflight_client_gets_the_log_probs_of_its_tokens(client: Run, reference: Reference) -> None:
    prompt = reference.ids(PROMPT)
    tokens = reference.greedy(prompt, 16)
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output", "--return-log-probs")
    output = ok(inflight(client, *args))
    logprobs = torch.log_softmax(reference.logits(prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
    expected = [float(logprobs[i, t]) for i, t in enumerate(tokens)]
    assert numbers(output, "output_log_probs:") == pytest.approx(expected, abs=1e-3)
    assert numbers(output, "cum_log_probs:") == pytest.approx([sum(expected)], abs=1e-2)


def test_inflight_client_gets_the_context_logits_of_its_prompt(client: Run, reference: Reference) -> None:
    prompt = reference.ids(PROMPT)
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output", "--return-context-logits")
    output = ok(inflight(client, *args))
    assert f"context_logits.shape: (1, {len(prompt)}, {reference.vocab})" in output
    # numpy prints the first three logits of the first prompt position first.
    first = reference.logits(prompt)[0, :3].tolist()
    assert numbers(output, "context_logits:")[:3] == pytest.approx(first, abs=1e-4)


def test_inflight_client_gets_the_generation_logits_of_its_tokens(client: Run, reference: Reference) -> None:
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output", "--return-generation-logits")
    output = ok(inflight(client, *args))
    assert f"generation_logits.shape: (1, 16, {reference.vocab})" in output
    prompt = reference.ids(PROMPT)
    first = reference.logits(prompt)[-1, :3].tolist()  # the first new token's logits
    assert numbers(output, "generation_logits:")[:3] == pytest.approx(first, abs=1e-4)


def test_inflight_client_gets_perf_metrics(client: Run, reference: Reference) -> None:
    output = ok(inflight(client, "--model-name", "llm_engine", "--streaming", "--return-perf-metrics"))
    check_perf_metrics(metrics(output), len(reference.ids(PROMPT)))


def test_inflight_client_gets_the_input_and_output_token_counts(client: Run, reference: Reference) -> None:
    args = ("--model-name", "llm_engine_nondecoupled", "--exclude-input-in-output")
    output = ok(inflight(client, *args, "--return-num-input-tokens", "--return-num-output-tokens"))
    assert f"Input token count: [[{len(reference.ids(PROMPT))}]]" in output
    assert "Output token count: [[16]]" in output


def test_inflight_client_lookahead_decoding_gives_the_greedy_tokens(
    client: Run, reference: Reference, tmp_path: Path
) -> None:
    # Within llm_engine's own lookahead configuration ([7,7,7]): lookahead decoding is exact.
    prompt = reference.ids(PROMPT)
    csv = expected_csv(tmp_path, prompt + reference.greedy(prompt, 16))
    args = ("--model-name", "llm_engine", "--streaming", "--lookahead_config=[5,3,2]")
    output = ok(inflight(client, *args, "--check-output", "--output-tokens-csv", csv))
    assert "PASS!" in output


def test_inflight_client_lookahead_beyond_the_models_configuration_is_refused(client: Run) -> None:
    output = failed(inflight(client, "--model-name", "llm_engine", "--streaming", "--lookahead_config=[8,7,7]"))
    assert "the lookahead configuration [8,7,7] exceeds the model's [7, 7, 7]" in output


def test_inflight_client_num_return_sequences_samples_each_with_its_own_seed(client: Run) -> None:
    args = ("--model-name", "llm_engine", "--exclude-input-in-output", "-n", "2", "--top-k", "20")
    output = ok(inflight(client, *args))
    beams = re.findall(r"^Output beam (\d): (.*)$", output, re.MULTILINE)
    assert [index for index, _ in beams] == ["0", "1"]
    assert beams[0][1] != beams[1][1]


def test_inflight_client_beam_search_is_refused_by_name(client: Run) -> None:
    output = failed(inflight(client, "--model-name", "llm_engine", "--streaming", "--beam-width", "2"))
    assert "beam_width other than 1 is not supported" in output


def test_inflight_client_gets_exactly_the_outputs_it_requests(client: Run) -> None:
    # The client fails if a response holds other outputs than those it named.
    args = ("--model-name", "llm_engine", "--streaming")
    output = ok(inflight(client, *args, "--requested-outputs", "output_ids", "sequence_length"))
    assert "Output beam 0:" in output


# -- end_to_end_grpc_client.py: text, the ensemble model ------------------------------------


def test_end_to_end_client_gets_the_prompt_and_the_greedy_text(client: Run, reference: Reference) -> None:
    # exclude_input_in_output false (the client's default): the text begins with the prompt;
    # the client checks it is the prompt and then the expected text.
    prompt = reference.ids(PROMPT)
    whole = reference.text(prompt + reference.greedy(prompt, 10))
    assert whole.startswith(PROMPT)
    expected = json.dumps([whole[len(PROMPT) :]])
    ok(end_to_end(client, "-p", PROMPT, "-o", "10", "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_streams_the_greedy_text(client: Run, reference: Reference) -> None:
    # Each streamed response is detokenized alone, as tensorrtllm_backend's postprocessing does.
    tokens = reference.greedy(reference.ids(PROMPT), 10)
    expected = json.dumps(["".join(reference.text([t]) for t in tokens)])
    ok(end_to_end(client, "-p", PROMPT, "-o", "10", "--streaming", "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_excluding_the_input_gets_the_new_text_only(client: Run, reference: Reference) -> None:
    expected = json.dumps([reference.text(reference.greedy(reference.ids(PROMPT), 10))])
    args = ("-p", PROMPT, "-o", "10", "--exclude-input-in-output")
    ok(end_to_end(client, *args, "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_stop_word_ends_the_text_right_after_it(client: Run, reference: Reference) -> None:
    tokens = reference.greedy(reference.ids(PROMPT), 30)
    candidates = reference.single_token_words(tokens)
    position = max(tokens.index(t) for t in candidates)  # (its first occurrence)
    assert position < len(tokens) - 1
    stop = reference.text([tokens[position]])
    expected = json.dumps([reference.text(tokens[: position + 1])])
    args = ("-p", PROMPT, "-o", "30", "--exclude-input-in-output", "--stop-words", stop)
    ok(end_to_end(client, *args, "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_bad_word_is_never_generated(client: Run, reference: Reference) -> None:
    prompt = reference.ids(PROMPT)
    banned = reference.single_token_words(reference.greedy(prompt, 10))[0]
    tokens = reference.greedy(prompt, 10, banned=(banned,))
    assert banned not in tokens
    expected = json.dumps([reference.text(tokens)])
    args = ("-p", PROMPT, "-o", "10", "--exclude-input-in-output", "--bad-words", reference.text([banned]))
    ok(end_to_end(client, *args, "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_embedding_bias_is_added_to_the_logits(client: Run, reference: Reference) -> None:
    prompt = reference.ids(PROMPT)
    usual = reference.greedy(prompt, 8)
    word = next(
        t
        for t in range(100, reference.vocab)
        if t not in usual and reference.text([t]).strip().isalpha() and reference.single_token_words([t])
    )
    tokens = reference.greedy(prompt, 8, bias={word: 20.0})
    assert word in tokens
    expected = json.dumps([reference.text(tokens)])
    args = ("-p", PROMPT, "-o", "8", "--exclude-input-in-output")
    bias = ("--embedding-bias-words", reference.text([word]), "--embedding-bias-weights", "20")
    ok(end_to_end(client, *args, *bias, "--check-outputs", "--expected-outputs", expected))


def test_end_to_end_client_gets_perf_metrics(client: Run, reference: Reference) -> None:
    output = ok(end_to_end(client, "-p", PROMPT, "-o", "8", "--return-perf-metrics"))
    check_perf_metrics(metrics(output), len(reference.ids(PROMPT)))


def test_end_to_end_client_gets_the_context_logits_of_its_prompt(client: Run, reference: Reference) -> None:
    output = ok(end_to_end(client, "-p", PROMPT, "-o", "4", "--return-context-logits"))
    prompt = reference.ids(PROMPT)
    assert f"context_logits.shape: (1, {len(prompt)}, {reference.vocab})" in output
    first = reference.logits(prompt)[0, :3].tolist()
    assert numbers(output, "context_logits:")[:3] == pytest.approx(first, abs=1e-4)


def test_end_to_end_client_gets_the_log_probs_of_its_tokens(client: Run, reference: Reference) -> None:
    prompt = reference.ids(PROMPT)
    tokens = reference.greedy(prompt, 6)
    output = ok(end_to_end(client, "-p", PROMPT, "-o", "6", "--return-log-probs"))
    logprobs = torch.log_softmax(reference.logits(prompt + tokens)[len(prompt) - 1 : -1], dim=-1)
    expected = [float(logprobs[i, t]) for i, t in enumerate(tokens)]
    assert f"output_log_probs.shape: (1, 1, {len(tokens)})" in output
    assert numbers(output, "output_log_probs:") == pytest.approx(expected, abs=1e-3)


def test_end_to_end_client_guided_decoding_returns_json_of_the_schema(client: Run) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    args = ("-p", PROMPT, "-o", "40", "--exclude-input-in-output", "--guided-decoding-guide-type", "json_schema")
    output = ok(end_to_end(client, *args, "--guided-decoding-guide", json.dumps(schema)))
    text = re.search(r"^0: (.*)$", output, re.MULTILINE)
    assert text, output
    value = json.loads(text.group(1))
    assert set(value) == {"ok"} and isinstance(value["ok"], bool)


def test_end_to_end_client_batched_prompts_each_get_their_text(client: Run, reference: Reference) -> None:
    prompts = [PROMPT, "The gateway"]
    texts = []
    for prompt in prompts:
        ids = reference.ids(prompt)
        whole = reference.text(ids + reference.greedy(ids, 6))
        assert whole.startswith(prompt)
        texts.append(whole[len(prompt) :])
    args = ("-p", json.dumps(prompts), "-o", "6", "--batch-inputs")
    output = ok(end_to_end(client, *args, "--check-outputs", "--expected-outputs", json.dumps(texts)))
    assert re.search(r"^1: The gateway", output, re.MULTILINE)  # (each has its batch_index)


# -- llmapi_client.py: text, TensorRT-LLM's llmapi model --------------------------------------


def llmapi_text(reference: Reference, count: int = 16) -> str:
    """llm_llmapi's text: the prompt's (exclude_input_from_output is false), then the new text."""
    prompt = reference.fast.encode(PROMPT).ids
    tokens = reference.greedy(prompt, count)
    return reference.fast.decode(prompt, skip_special_tokens=True) + reference.fast.decode(
        tokens, skip_special_tokens=True
    )


def test_llmapi_client_gets_the_text_from_the_non_decoupled_model(client: Run, reference: Reference) -> None:
    output = ok(llmapi(client, "--model-name", "llm_llmapi_nondecoupled"))
    assert f"Output text: {llmapi_text(reference)}\n" in output


def test_llmapi_client_streaming_takes_the_stream_rpc_of_the_decoupled_model(client: Run, reference: Reference) -> None:
    output = ok(llmapi(client, "--model-name", "llm_llmapi", "--streaming"))
    assert f"Output text: {llmapi_text(reference)}\n" in output


def test_llmapi_client_without_streaming_is_refused_by_the_decoupled_model(client: Run) -> None:
    output = failed(llmapi(client, "--model-name", "llm_llmapi"))
    assert "ModelInfer RPC doesn't support models with decoupled transaction policy" in output


def test_llmapi_client_stop_request_cancels_a_running_request(client: Run) -> None:
    args = ("--model-name", "llm_llmapi", "--request-output-len", "220", "--stop-after-ms", "60")
    output = ok(llmapi(client, *args, "--request-id", "llmapi-stop-1"))
    assert "Request is cancelled" in output
    assert "Output text:" not in output


def test_llmapi_client_stop_request_cancels_a_request_of_the_non_decoupled_model(client: Run) -> None:
    args = ("--model-name", "llm_llmapi_nondecoupled", "--request-output-len", "220", "--stop-after-ms", "60")
    output = ok(llmapi(client, *args, "--request-id", "llmapi-stop-2"))
    assert "Request is cancelled" in output
    assert "Output text:" not in output


def test_llmapi_client_request_cancel_is_reported_as_cancelled(client: Run) -> None:
    args = ("--model-name", "llm_llmapi", "--request-output-len", "220", "--stop-after-ms", "60")
    output = ok(llmapi(client, *args, "--stop-via-request-cancel"))
    assert "Request is cancelled" in output


def test_llmapi_client_lora_is_refused_by_name(client: Run) -> None:
    args = ("--model-name", "llm_llmapi_nondecoupled", "--lora-id", "1", "--lora-name", "a", "--lora-path", "/nowhere")
    output = failed(llmapi(client, *args))
    assert "invalid input: lora_id is not supported by this stand-in" in output


# -- the models' configurations -------------------------------------------------------------


def _config(name: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse((MODEL_REPO / name / "config.pbtxt").read_text(), model_config_pb2.ModelConfig())


def _io(config: model_config_pb2.ModelConfig) -> tuple[set[str], set[str]]:
    return {text_format.MessageToString(t, as_one_line=True) for t in config.input}, {
        text_format.MessageToString(t, as_one_line=True) for t in config.output
    }


@pytest.mark.parametrize(
    ("twin", "model"), [("llm_engine_nondecoupled", "llm_engine"), ("llm_llmapi_nondecoupled", "llm_llmapi")]
)
def test_the_non_decoupled_models_are_their_decoupled_twins_but_for_the_policy(twin: str, model: str) -> None:
    other, original = _config(twin), _config(model)
    assert _io(other) == _io(original)
    assert other.max_batch_size == original.max_batch_size
    assert (other.model_transaction_policy.decoupled, original.model_transaction_policy.decoupled) == (False, True)
    assert os.path.realpath(MODEL_REPO / twin / "1" / "model.py") == os.path.realpath(
        MODEL_REPO / model / "1" / "model.py"
    )
