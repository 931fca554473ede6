"""CLIP text tower + projection on CPU; L2-normalised text embeddings."""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import CLIPTextModelWithProjection


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.model = CLIPTextModelWithProjection.from_pretrained(model_dir, dtype=torch.float32).eval()

    def execute(self, requests):
        ids = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "attention_mask").as_numpy() for r in requests]
        with torch.inference_mode():
            out = self.model(input_ids=torch.from_numpy(np.concatenate(ids)), attention_mask=torch.from_numpy(np.concatenate(masks)))
            embeds = torch.nn.functional.normalize(out.text_embeds, dim=-1).numpy()
        responses, start = [], 0
        for batch in ids:
            part = embeds[start : start + len(batch)]
            start += len(batch)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_embeds", part.astype(np.float32))]))
        return responses
