"""Triton python model: text -> CLIP input_ids and attention_mask, [77] int32 each, and
num_tokens [1] int32 (each text's own tokens: the gateway's usage).

Padded and truncated to CLIP's 77 positions, so every request has the plan's fixed shape.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported by tests outside Triton
    pb_utils = None

CONTEXT_LENGTH = 77


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def tokenize(tokenizer: Any, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=CONTEXT_LENGTH, return_tensors="np")
    return encoded["input_ids"].astype(np.int32), encoded["attention_mask"].astype(np.int32)


def texts_of(array: np.ndarray) -> list[str]:
    rows = array.reshape(array.shape[0], -1)
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in rows[:, 0]]


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.tokenizer = load_tokenizer(params["hf_model_dir"])

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            texts = texts_of(pb_utils.get_input_tensor_by_name(request, "text").as_numpy())
            input_ids, attention_mask = tokenize(self.tokenizer, texts)
            counts = attention_mask.sum(axis=1, dtype=np.int32).reshape(-1, 1)
            tensors = [
                pb_utils.Tensor("input_ids", input_ids),
                pb_utils.Tensor("attention_mask", attention_mask),
                pb_utils.Tensor("num_tokens", counts),
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
