"""Triton python model: prompts and word lists -> token ids for the tensorrt_llm step.

The helpers above the model class are plain functions of a tokenizer and numpy arrays,
so they can be tested without Triton.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests outside Triton: only the helpers are used
    pb_utils = None


def load_tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def pad_token_id(tokenizer: Any) -> int:
    # GPT-2 has no pad token; padding is cut off by input_lengths anyway.
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ValueError("the tokenizer has neither a pad nor an end-of-sequence token")
    return int(pad)


def _text(value: object) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def strings(array: np.ndarray) -> list[list[str]]:
    """A [batch, n] TYPE_STRING tensor as lists of str, empty strings dropped."""
    return [[w for w in map(_text, row) if w] for row in array.reshape(array.shape[0], -1)]


def encode_prompts(
    tokenizer: Any, prompts: list[str], max_input_len: int, pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids [batch, longest] padded with pad_id, and lengths [batch, 1]."""
    encoded = [tokenizer.encode(prompt) for prompt in prompts]
    for tokens in encoded:
        if not tokens:
            raise ValueError("text_input is empty")
        if len(tokens) > max_input_len:
            raise ValueError(
                f"prompt is {len(tokens)} tokens long; this deployment accepts at most {max_input_len} "
                "(max_input_len of the engine)"
            )
    longest = max(len(tokens) for tokens in encoded)
    ids = np.full((len(encoded), longest), pad_id, dtype=np.int32)
    for row, tokens in enumerate(encoded):
        ids[row, : len(tokens)] = tokens
    lengths = np.array([[len(tokens)] for tokens in encoded], dtype=np.int32)
    return ids, lengths


def word_list(tokenizer: Any, rows: list[list[str]]) -> np.ndarray:
    """TensorRT-LLM's word-list layout, [batch, 2, n]: row 0 the token ids of all words
    one after another (padded with 0), row 1 the end offset of each word (padded with -1).
    A request with no words gets a single -1 offset, which means "none"."""
    flat: list[list[int]] = []
    ends: list[list[int]] = []
    for words in rows:
        ids: list[int] = []
        offsets: list[int] = []
        for word in words:
            tokens = tokenizer.encode(word, add_special_tokens=False)
            if tokens:
                ids.extend(tokens)
                offsets.append(len(ids))
        flat.append(ids)
        ends.append(offsets)
    width = max([1] + [len(ids) for ids in flat] + [len(offsets) for offsets in ends])
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for row, (ids, offsets) in enumerate(zip(flat, ends, strict=True)):
        out[row, 0, : len(ids)] = ids
        out[row, 1, : len(offsets)] = offsets
    return out


def preprocess(
    tokenizer: Any,
    max_input_len: int,
    text_input: np.ndarray,
    bad_words: np.ndarray | None = None,
    stop_words: np.ndarray | None = None,
    end_id: np.ndarray | None = None,
    pad_id: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    batch = text_input.shape[0]
    prompts = [_text(row[0]) if row.size else "" for row in text_input.reshape(batch, -1)]
    default_pad = pad_token_id(tokenizer)
    ids, lengths = encode_prompts(tokenizer, prompts, max_input_len, default_pad)
    no_words: list[list[str]] = [[] for _ in range(batch)]
    eos = tokenizer.eos_token_id
    if end_id is None and eos is None:
        raise ValueError("end_id is required: the tokenizer has no end-of-sequence token")
    return {
        "input_ids": ids,
        "input_lengths": lengths,
        "stop_words_list": word_list(tokenizer, strings(stop_words) if stop_words is not None else no_words),
        "bad_words_list": word_list(tokenizer, strings(bad_words) if bad_words is not None else no_words),
        "out_end_id": (end_id if end_id is not None else np.full((batch, 1), eos)).astype(np.int32),
        "out_pad_id": (pad_id if pad_id is not None else np.full((batch, 1), default_pad)).astype(np.int32),
    }


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(params["tokenizer_dir"])
        self.max_input_len = int(params["max_input_len"])

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            try:
                inputs = {
                    name: _optional(request, name)
                    for name in ("text_input", "bad_words", "stop_words", "end_id", "pad_id")
                }
                if inputs["text_input"] is None:
                    raise ValueError("text_input is required")
                outputs = preprocess(self.tokenizer, self.max_input_len, **inputs)
                tensors = [pb_utils.Tensor(name, array) for name, array in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except ValueError as exc:
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(exc))))
        return responses


def _optional(request: Any, name: str) -> np.ndarray | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    return None if tensor is None else tensor.as_numpy()
