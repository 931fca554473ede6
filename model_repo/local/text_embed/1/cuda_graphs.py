"""Batches of an encoder replayed as CUDA graphs, one per (batch, length) bucket.

A small encoder's eager forward on a GPU is bound by its kernel launches (MiniLM: ~100
launches, ~3.4 ms whatever the batch on an H200); a replayed graph runs the same kernels
back to back (0.4-1.1 ms for 16-256 texts; bench/embed_graphs.py). A batch is padded up to
the smallest bucket that holds it (padded rows are discarded), each bucket's graph is
captured at its first use, and all of them share one memory pool (they replay one after
another on the instance's stream). A bucket whose capture fails runs eagerly from then on.
Used by text_embed and clip_text_encoder (which puts this folder on its path)."""

from collections.abc import Callable

import torch

BATCHES = (8, 16, 32, 64, 128, 256)
LENGTHS = (16, 32, 64, 128, 256)


def buckets(sizes: tuple[int, ...], largest: int) -> tuple[int, ...]:
    """The sizes below `largest`, then `largest` itself."""
    return (*(size for size in sizes if size < largest), largest)


class BucketGraphs:
    def __init__(
        self,
        forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        device: str,
        *,
        max_batch: int,
        lengths: tuple[int, ...],
    ) -> None:
        """forward(ids, mask) -> one row per input row; ids and mask int64 [batch, length]."""
        self.forward = forward
        self.device = device
        self.batches = buckets(BATCHES, max_batch)
        self.lengths = lengths
        self.pool = torch.cuda.graph_pool_handle()
        self.captured: dict[tuple[int, int], tuple | None] = {}  # None: capture failed, eager

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows, length = ids.shape
        if rows > self.batches[-1] or length > self.lengths[-1]:
            return self.forward(ids, mask)
        key = (next(b for b in self.batches if b >= rows), next(n for n in self.lengths if n >= length))
        if key not in self.captured:
            self.captured[key] = self._capture(*key)
        found = self.captured[key]
        if found is None:
            return self.forward(ids, mask)
        graph, static_ids, static_mask, output = found
        static_ids.zero_()
        static_mask.zero_()
        static_mask[:, 0] = 1  # padded rows attend to one token: no all-masked row
        static_ids[:rows, :length].copy_(ids)
        static_mask[:rows, :length].copy_(mask)
        graph.replay()
        return output[:rows]

    def _capture(self, batch: int, length: int) -> tuple | None:
        ids = torch.zeros((batch, length), dtype=torch.long, device=self.device)
        mask = torch.ones((batch, length), dtype=torch.long, device=self.device)
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up, as capture asks
                    self.forward(ids, mask)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                output = self.forward(ids, mask)
        except Exception as exc:  # an operation capture does not allow: stay eager
            print(f"cuda_graphs: bucket {batch}x{length} runs eagerly: {type(exc).__name__}: {exc}", flush=True)
            torch.cuda.synchronize()
            return None
        return graph, ids, mask, output
