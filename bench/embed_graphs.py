"""How fast a MiniLM-shaped encoder (text_embed's: 6 layers, 384 wide) runs a batch on the
GPU, eager against one CUDA graph per (batch, length) bucket: the forward pass with mean
pooling and normalising, as model_repo/local/text_embed runs it. Random weights (the
speed depends on the shape only). Needs a CUDA GPU:

    python bench/embed_graphs.py [--batches 16,32,64,128,256] [--lengths 16,32,64]
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
from transformers import BertConfig, BertModel


def pooled(model: BertModel, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    tokens = model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
    weights = mask.unsqueeze(-1).to(tokens.dtype)
    return torch.nn.functional.normalize((tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9), dim=-1)


def timed(step, iterations: int) -> float:
    """Seconds per call of step, after a warm-up."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iterations


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="16,32,64,128,256")
    parser.add_argument("--lengths", default="16,32,64")
    parser.add_argument("--iterations", type=int, default=50)
    args = parser.parse_args()
    config = BertConfig(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, vocab_size=30522
    )
    model = BertModel(config).half().cuda().eval()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| batch | length | eager ms | graph ms | eager emb/s | graph emb/s |")
    print("| --- | --- | --- | --- | --- | --- |")
    with torch.inference_mode():
        for length in (int(x) for x in args.lengths.split(",")):
            for batch in (int(x) for x in args.batches.split(",")):
                ids = torch.randint(0, config.vocab_size, (batch, length), device="cuda")
                mask = torch.ones(batch, length, dtype=torch.long, device="cuda")
                mask[:, length // 2 :] = 0  # padded, as real batches are
                eager = timed(functools.partial(pooled, model, ids, mask), args.iterations)
                try:
                    stream = torch.cuda.Stream()
                    stream.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(stream):
                        for _ in range(3):
                            pooled(model, ids, mask)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        pooled(model, ids, mask)
                    replay = timed(graph.replay, args.iterations)
                    graph_ms, graph_rate = f"{replay * 1000:.3f}", f"{batch / replay:,.0f}"
                except Exception as exc:  # a forward that cannot be captured
                    graph_ms, graph_rate = f"capture failed: {type(exc).__name__}: {exc}"[:120], ""
                print(f"| {batch} | {length} | {eager * 1000:.3f} | {graph_ms} | {batch / eager:,.0f} | {graph_rate} |")


if __name__ == "__main__":
    main()
