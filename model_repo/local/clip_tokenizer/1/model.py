"""Text -> CLIP token ids and attention mask, padded to the text tower's context."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoConfig, AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.max_length = AutoConfig.from_pretrained(model_dir).text_config.max_position_embeddings

    def execute(self, requests):
        # All the requests Triton hands over in one tokenizer call (one pass in Rust instead
        # of one per request), split back by request.
        per_request = [pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1) for request in requests]
        texts = [t.decode("utf-8", errors="replace") for batch in per_request for t in batch]
        encoded = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="np")
        ids, mask = encoded["input_ids"].astype(np.int64), encoded["attention_mask"].astype(np.int64)
        counts = mask.sum(axis=1, dtype=np.int32).reshape(-1, 1)
        responses, start = [], 0
        for batch in per_request:
            end = start + len(batch)
            tensors = [
                pb_utils.Tensor("input_ids", ids[start:end]),
                pb_utils.Tensor("attention_mask", mask[start:end]),
                pb_utils.Tensor("num_tokens", counts[start:end]),
            ]
            responses.append(pb_utils.InferenceResponse(tensors))
            start = end
        return responses
