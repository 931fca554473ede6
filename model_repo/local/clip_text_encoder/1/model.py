"""CLIP text tower + projection; L2-normalised text embeddings (float32).

On the CPU in float32, or on the GPU Triton gives the instance (KIND_GPU) in the config's
dtype, each batch then a CUDA graph of its bucket (text_embed/1/cuda_graphs.py: the tower's
eager forward is bound by its kernel launches)."""

import json
import os
import sys

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import CLIPTextModelWithProjection

sys.path.append(os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "text_embed", "1")))
from cuda_graphs import BucketGraphs  # noqa: E402


def placement(args, params) -> tuple[str, "torch.dtype"]:
    """Where Triton placed this instance (KIND_GPU: its GPU) and the dtype the config asks for
    (the launcher renders float16 for the GPU; float32 otherwise)."""
    device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else "cpu"
    return device, getattr(torch, params.get("dtype", {}).get("string_value", "float32"))


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        model_dir = os.path.expandvars(params["model_dir"]["string_value"])
        self.device, dtype = placement(args, params)
        self.model = CLIPTextModelWithProjection.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.graphs = None
        if self.device.startswith("cuda"):  # the tokenizer pads every text to the context length
            length = self.model.config.max_position_embeddings
            max_batch = int(json.loads(args["model_config"]).get("max_batch_size") or 1)
            self.graphs = BucketGraphs(self.embed, self.device, max_batch=max_batch, lengths=(length,))

    def embed(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask)
        return torch.nn.functional.normalize(out.text_embeds.float(), dim=-1)

    def execute(self, requests):
        ids = [pb_utils.get_input_tensor_by_name(r, "input_ids").as_numpy() for r in requests]
        masks = [pb_utils.get_input_tensor_by_name(r, "attention_mask").as_numpy() for r in requests]
        input_ids = torch.from_numpy(np.concatenate(ids)).to(self.device)
        attention_mask = torch.from_numpy(np.concatenate(masks)).to(self.device)
        with torch.inference_mode():
            run = self.graphs if self.graphs is not None else self.embed
            embeds = run(input_ids, attention_mask).cpu().numpy()
        responses, start = [], 0
        for batch in ids:
            part = embeds[start : start + len(batch)]
            start += len(batch)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("text_embeds", part.astype(np.float32))]))
        return responses
