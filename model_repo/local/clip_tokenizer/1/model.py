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
        responses = []
        for request in requests:
            texts = [t.decode("utf-8", errors="replace") for t in pb_utils.get_input_tensor_by_name(request, "text").as_numpy().reshape(-1)]
            encoded = self.tokenizer(texts, padding="max_length", truncation=True, max_length=self.max_length, return_tensors="np")
            responses.append(
                pb_utils.InferenceResponse(
                    [
                        pb_utils.Tensor("input_ids", encoded["input_ids"].astype(np.int64)),
                        pb_utils.Tensor("attention_mask", encoded["attention_mask"].astype(np.int64)),
                    ]
                )
            )
        return responses
