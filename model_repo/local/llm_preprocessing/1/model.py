"""Tokenize the prompt; stop and bad words to TensorRT-LLM's word-list format; embedding-bias
words and weights to a vocabulary row (as tensorrtllm_backend's preprocessing does)."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


def to_word_list(tokenizer, words: list[str]) -> np.ndarray:
    """[2, N] int32: row 0 the words' token ids end to end, row 1 each word's end offset
    (padded with -1). No words gives [[0], [-1]], as tensorrtllm_backend does."""
    ids: list[int] = []
    offsets: list[int] = []
    for word in words:
        tokens = tokenizer.encode(word, add_special_tokens=False)
        if tokens:
            ids.extend(tokens)
            offsets.append(len(ids))
    if not ids:
        return np.array([[0], [-1]], dtype=np.int32)
    offsets += [-1] * (len(ids) - len(offsets))
    return np.array([ids, offsets], dtype=np.int32)


def stack_padded(rows: list[np.ndarray], pad: int) -> np.ndarray:
    width = max(row.shape[-1] for row in rows)
    return np.stack([np.pad(row, [(0, 0)] * (row.ndim - 1) + [(0, width - row.shape[-1])], constant_values=pad) for row in rows])


def embedding_bias(tokenizer, words: list[list[str]], weights, batch: int) -> np.ndarray:
    """[batch, vocabulary] FP32: each word's weight added at each of its token ids; with no
    words, [batch, 0] (the engine takes an empty bias as none)."""
    if not words or weights is None:
        return np.zeros((batch, 0), dtype=np.float32)
    rows = []
    for row_words, row_weights in zip(words, weights.reshape(len(words), -1), strict=True):
        if len(row_words) != len(row_weights):
            raise ValueError("embedding_bias_words and embedding_bias_weights must have the same length")
        bias = np.zeros(len(tokenizer), dtype=np.float32)
        for word, weight in zip(row_words, row_weights, strict=True):
            for token in tokenizer.encode(word, add_special_tokens=False):
                bias[token] += weight
        rows.append(bias)
    return np.stack(rows)


def strings(tensor) -> list[list[str]]:
    if tensor is None:
        return []
    return [[item.decode("utf-8") if isinstance(item, bytes) else str(item) for item in row] for row in tensor.as_numpy()]


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def execute(self, requests):
        return [self._one(request) for request in requests]

    def _one(self, request):
        try:
            prompts = [row[0] for row in strings(pb_utils.get_input_tensor_by_name(request, "text_input"))]
            max_tokens = pb_utils.get_input_tensor_by_name(request, "max_tokens").as_numpy().reshape(-1, 1)
            stop = strings(pb_utils.get_input_tensor_by_name(request, "stop_words")) or [[]] * len(prompts)
            bad = strings(pb_utils.get_input_tensor_by_name(request, "bad_words")) or [[]] * len(prompts)
            if (max_tokens < 1).any():
                raise ValueError("max_tokens must be at least 1")
            encoded = [np.array(self.tokenizer.encode(p), dtype=np.int32) for p in prompts]
            if any(len(e) == 0 for e in encoded):
                raise ValueError("text_input is empty after tokenization")
            pad_id = self.tokenizer.pad_token_id or 0
            bias_words = strings(pb_utils.get_input_tensor_by_name(request, "embedding_bias_words"))
            bias_weights = pb_utils.get_input_tensor_by_name(request, "embedding_bias_weights")
            if bool(bias_words) != (bias_weights is not None):
                raise ValueError("embedding_bias_words and embedding_bias_weights come together")
            bias = embedding_bias(
                self.tokenizer, bias_words, None if bias_weights is None else bias_weights.as_numpy(), len(prompts)
            )
            outputs = [
                pb_utils.Tensor("input_ids", stack_padded(encoded, pad_id)),
                pb_utils.Tensor("input_lengths", np.array([[len(e)] for e in encoded], dtype=np.int32)),
                pb_utils.Tensor("request_output_len", max_tokens.astype(np.int32)),
                pb_utils.Tensor("stop_words_list", stack_padded([to_word_list(self.tokenizer, w) for w in stop], -1)),
                pb_utils.Tensor("bad_words_list", stack_padded([to_word_list(self.tokenizer, w) for w in bad], -1)),
                pb_utils.Tensor("embedding_bias", bias),
            ]
            return pb_utils.InferenceResponse(output_tensors=outputs)
        except Exception as exc:  # a bad request must not take the model down
            return pb_utils.InferenceResponse(error=pb_utils.TritonError(f"invalid input: {exc}", pb_utils.TritonError.INVALID_ARG))
