"""Detokenize a chunk of generated token ids.

The generator only cuts chunks where the text so far decodes to whole characters, so
the chunks' texts joined equal the decoded text of all the tokens."""

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
            texts = [self.tokenizer.decode(row.tolist(), skip_special_tokens=True, clean_up_tokenization_spaces=False) for row in ids]
            text = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_output", text)]))
        return responses
