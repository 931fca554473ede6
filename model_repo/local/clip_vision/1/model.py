"""CLIP vision tower + projection; L2-normalised image embeddings (float32).

On the CPU in float32, or on the GPU Triton gives the instance (KIND_GPU) in the config's
dtype. Dynamic batching hands several requests at once: they run as one batch."""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import CLIPVisionModelWithProjection


def placement(args, params) -> tuple[str, "torch.dtype"]:
    """Where Triton placed this instance (KIND_GPU: its GPU) and the dtype the config asks for
    (the launcher renders float16 for the GPU; float32 otherwise)."""
    device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else "cpu"
    return device, getattr(torch, params.get("dtype", {}).get("string_value", "float32"))


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.device, self.dtype = placement(args, params)
        self.model = CLIPVisionModelWithProjection.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()

    def execute(self, requests):
        batches = [pb_utils.get_input_tensor_by_name(r, "pixel_values").as_numpy() for r in requests]
        pixels = torch.from_numpy(np.concatenate(batches)).to(self.device, self.dtype)
        with torch.inference_mode():
            embeds = self.model(pixel_values=pixels).image_embeds.float()
            embeds = torch.nn.functional.normalize(embeds, dim=-1).cpu().numpy()
        responses, start = [], 0
        for batch in batches:
            part = embeds[start : start + len(batch)]
            start += len(batch)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("image_embeds", part.astype(np.float32))]))
        return responses
