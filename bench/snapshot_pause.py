"""How long the binder's other threads wait while its index writes a snapshot: the longest
pause of a thread that wakes every millisecond, while VectorIndex.snapshot writes N
vectors (8-dimensional: what is measured is the per-vector Python work, the request ids
and expiry times of the snapshot's meta, not the FAISS file). The binder's /search and
/healthz answer from its event loop, which waits as long as this thread does.

Run:  .venv/bin/python -m bench.snapshot_pause --vectors 120000,1000000
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from binder.index.vectors import Item, VectorIndex


def longest_pause(count: int) -> tuple[float, float]:
    """(seconds the snapshot took, the longest pause of another thread meanwhile)."""
    with tempfile.TemporaryDirectory() as directory:
        index = VectorIndex(Path(directory), use_gpu=False)
        vectors = np.random.default_rng(1).standard_normal((count, 8)).astype(np.float32)
        index.add([Item("space", "tenant", f"0193A5C8D7E6ABCDEFGHJKMNPQRS{i:08d}", vectors[i]) for i in range(count)])
        done = False
        gaps: list[float] = []

        def wake_every_millisecond() -> None:
            last = time.perf_counter()
            while not done:
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        thread = threading.Thread(target=wake_every_millisecond)
        thread.start()
        started = time.perf_counter()
        index.snapshot()
        took = time.perf_counter() - started
        done = True
        thread.join()
        return took, max(gaps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vectors", default="120000,1000000", help="comma separated")
    args = parser.parse_args()
    print("| vectors | snapshot s | longest pause of another thread, ms |")
    print("| --- | --- | --- |")
    for count in (int(v) for v in args.vectors.split(",")):
        took, pause = longest_pause(count)
        print(f"| {count:,} | {took:.2f} | {pause * 1000:.0f} |")


if __name__ == "__main__":
    main()
