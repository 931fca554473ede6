"""Binder benchmarks, against a real Redis and the local MongoDB-wire server (nx-27017):

1. Store throughput: N results published to the results stream at once; how fast one
   binder process writes them to MongoDB (and indexes the vectors), with and without
   embeddings.
2. Search: 100k L2-normalised vectors of 384 and 512 dimensions on the CPU. Latency and
   QPS of FAISS itself (IndexIDMap2 over IndexFlatIP, exact search), and end to end
   through the binder's HTTP /search (the path the gateway uses).

Run:  .venv/bin/python -m bench.binder_bench [--results 20000] [--vectors 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np
import redis.asyncio as aioredis
from pymongo import AsyncMongoClient

from binder.index.vectors import Item, VectorIndex
from gateway.common.result_store import RESULTS_COLLECTION
from gateway.protocol.records import DEFAULT_TENANT
from gateway.stack.process import ManagedProcess, free_port
from gateway.stack.services import binder_spec, mongo_spec, redis_spec
from tests.records import embedding_record, publish, text_record, unit_vectors

SPACE = "minilm"


def row(*cells: object) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def start(spec) -> ManagedProcess:
    process = ManagedProcess(spec)
    process.start()
    process.wait_ready(time.monotonic() + 60)
    return process


async def store_throughput(data: Path, redis_url: str, mongo_url: str, db: int, embeddings: bool, count: int) -> dict:
    env = {"REDIS_URL": f"{redis_url}/{db}", "MONGO_URL": mongo_url, "MONGO_DB": f"bench_{db}", "LOG_LEVEL": "WARNING"}
    port = free_port()
    binder = start(binder_spec(data_dir=data, host="127.0.0.1", port=port, env=env, name=f"binder-bench-{db}"))
    redis = aioredis.from_url(env["REDIS_URL"], decode_responses=True)
    mongo: AsyncMongoClient = AsyncMongoClient(mongo_url)
    try:
        vectors = unit_vectors(count, 384, seed=db)
        records = [
            embedding_record(vectors[i].tolist()) if embeddings else text_record(f"text {i}") for i in range(count)
        ]
        began = time.perf_counter()
        for offset in range(0, count, 2000):
            await publish(redis, records[offset : offset + 2000])
        published = time.perf_counter() - began
        collection = mongo[env["MONGO_DB"]][RESULTS_COLLECTION]
        while await collection.count_documents({}) < count:
            await asyncio.sleep(0.1)
        stored = time.perf_counter() - began
        indexed = None
        if embeddings:
            async with httpx.AsyncClient() as http:
                while (await http.get(f"http://127.0.0.1:{port}/healthz")).json()["index"].get("minilm", 0) < count:
                    await asyncio.sleep(0.05)
            indexed = time.perf_counter() - began
        return {"published_s": published, "stored_s": stored, "indexed_s": indexed}
    finally:
        await redis.aclose()
        await mongo.close()
        binder.stop()


def faiss_search(count: int, dim: int, queries: int, k: int) -> dict:
    index = VectorIndex(Path(tempfile.mkdtemp()), use_gpu=False)
    vectors = unit_vectors(count, dim, seed=dim)
    index.add([Item(SPACE, DEFAULT_TENANT, f"id-{i}", vectors[i].tolist()) for i in range(count)])
    probes = unit_vectors(queries, dim, seed=dim + 1)
    latencies = []
    for probe in probes:
        began = time.perf_counter()
        index.search(SPACE, probe.tolist(), k, DEFAULT_TENANT)
        latencies.append(time.perf_counter() - began)
    raw = index.shards[(SPACE, DEFAULT_TENANT)].index
    began = time.perf_counter()
    raw.search(probes, k)  # one batched call: the throughput FAISS can give
    batched = time.perf_counter() - began
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": float(np.percentile(latencies, 99)) * 1000,
        "qps_single": queries / sum(latencies),
        "qps_batched": queries / batched,
        "index": index,
    }


async def http_search(
    data: Path, index: VectorIndex, dim: int, redis_url: str, mongo_url: str, db: int, queries: int, k: int
) -> dict:
    """The same index, snapshotted and loaded by a binder process, queried over HTTP."""
    faiss_dir = data / "faiss" / f"binder-search-{dim}"
    index.directory = faiss_dir
    index.snapshot()
    env = {"REDIS_URL": f"{redis_url}/{db}", "MONGO_URL": mongo_url, "MONGO_DB": f"bench_{db}", "LOG_LEVEL": "WARNING"}
    port = free_port()
    binder = start(binder_spec(data_dir=data, host="127.0.0.1", port=port, env=env, name=f"binder-search-{dim}"))
    probes = unit_vectors(queries, dim, seed=dim + 2)
    latencies = []
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            for probe in probes:
                began = time.perf_counter()
                query = {"space": SPACE, "vector": probe.tolist(), "k": k, "tenant": DEFAULT_TENANT}
                response = await http.post("/search", json=query)
                response.raise_for_status()
                latencies.append(time.perf_counter() - began)
    finally:
        binder.stop()
    return {
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": float(np.percentile(latencies, 99)) * 1000,
        "qps": queries / sum(latencies),
    }


async def main(args: argparse.Namespace) -> str:
    data = Path(tempfile.mkdtemp(prefix="binder-bench-"))
    redis_port, mongo_port = free_port(), free_port()
    servers = [
        start(redis_spec(data_dir=data, host="127.0.0.1", port=redis_port)),
        start(mongo_spec(data_dir=data, host="127.0.0.1", port=mongo_port)),
    ]
    redis_url, mongo_url = f"redis://127.0.0.1:{redis_port}", f"mongodb://127.0.0.1:{mongo_port}"
    lines = [
        f"Store throughput: {args.results} results published at once, one binder process, "
        "MongoDB-wire server nx-27017.",
        "",
        row("results", "published in s", "all stored in s", "stored/s", "all indexed in s"),
        row(*["---"] * 5),
    ]
    try:
        for db, embeddings in ((1, False), (2, True)):
            r = await store_throughput(data, redis_url, mongo_url, db, embeddings, args.results)
            label = "with 384-d embeddings" if embeddings else "text only (llm)"
            lines.append(
                row(
                    label,
                    f"{r['published_s']:.2f}",
                    f"{r['stored_s']:.2f}",
                    f"{args.results / r['stored_s']:.0f}",
                    f"{r['indexed_s']:.2f}" if r["indexed_s"] else "-",
                )
            )
        lines += [
            "",
            f"Search over {args.vectors} vectors, k={args.k}, {args.queries} queries, CPU, exact inner product:",
            "",
            row(
                "dim",
                "FAISS p50 ms",
                "FAISS p99 ms",
                "FAISS QPS (one query a call)",
                "FAISS QPS (batched)",
                "binder HTTP p50 ms",
                "binder HTTP p99 ms",
                "binder HTTP QPS",
            ),
            row(*["---"] * 8),
        ]
        for db, dim in ((3, 384), (4, 512)):
            f = await asyncio.to_thread(faiss_search, args.vectors, dim, args.queries, args.k)
            h = await http_search(data, f["index"], dim, redis_url, mongo_url, db, args.queries, args.k)
            lines.append(
                row(
                    dim,
                    f"{f['p50_ms']:.2f}",
                    f"{f['p99_ms']:.2f}",
                    f"{f['qps_single']:.0f}",
                    f"{f['qps_batched']:.0f}",
                    f"{h['p50_ms']:.2f}",
                    f"{h['p99_ms']:.2f}",
                    f"{h['qps']:.0f}",
                )
            )
    finally:
        for server in reversed(servers):
            server.stop()
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=int, default=20000)
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=500)
    parser.add_argument("-k", type=int, default=10)
    print(asyncio.run(main(parser.parse_args())), file=sys.stdout)
