"""Detokenize a response of the engine: the first beam's tokens, up to its length.

Each response is detokenized on its own (as tensorrtllm_backend's postprocessing does),
so a character whose bytes span two streamed responses arrives as U+FFFD; the gateway's
engine path detokenizes incrementally and has no such gap."""

import json
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from transformers import AutoTokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def execute(self, requests):
        responses = []
        for request in requests:
            ids = pb_utils.get_input_tensor_by_name(request, "output_ids").as_numpy()
            lengths = pb_utils.get_input_tensor_by_name(request, "sequence_length").as_numpy()
            texts = []
            for row, length in zip(ids, lengths):
                tokens = row[0][: int(length.reshape(-1)[0])].tolist()
                texts.append(self.tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False))
            # One string per sequence, 1-D, as tensorrtllm_backend's postprocessing returns it
            # (its clients read text_output[0] as the text).
            text = np.array([t.encode("utf-8") for t in texts], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
