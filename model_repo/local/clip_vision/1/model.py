"""CLIP vision tower + projection on CPU; L2-normalised image embeddings.

Dynamic batching hands several requests at once: they run as one batch."""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import CLIPVisionModelWithProjection


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.model = CLIPVisionModelWithProjection.from_pretrained(model_dir, dtype=torch.float32).eval()

    def execute(self, requests):
        batches = [pb_utils.get_input_tensor_by_name(r, "pixel_values").as_numpy() for r in requests]
        with torch.inference_mode():
            embeds = self.model(pixel_values=torch.from_numpy(np.concatenate(batches))).image_embeds
            embeds = torch.nn.functional.normalize(embeds, dim=-1).numpy()
        responses, start = [], 0
        for batch in batches:
            part = embeds[start : start + len(batch)]
            start += len(batch)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("image_embeds", part.astype(np.float32))]))
        return responses
