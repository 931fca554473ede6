"""Start a local stack for a benchmark, on free ports, with the local profile's models
(SmolLM2, the demo CLIP unless real weights are there, MiniLM, the synthetic engine)."""

from __future__ import annotations

import contextlib
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gateway.stack import services
from gateway.stack.settings import StackSettings
from gateway.stack.stack import LocalStack

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Endpoints:
    gateway: str
    triton_grpc: str
    redis: str
    mongo: str
    binder: str
    api_key: str
    stack: LocalStack | None = None


@contextlib.contextmanager
def local_stack(
    data_dir: Path = ROOT / ".stack-bench", gateway_workers: int = 1, **service_env: str
) -> Iterator[Endpoints]:
    settings = StackSettings.on_free_ports(
        data_dir=data_dir,
        allow_downloads=False,
        gateway_workers=gateway_workers,
    )
    stack = LocalStack(
        settings,
        log=lambda line: print(line, file=sys.stderr),
        service_overrides={"LOG_LEVEL": "WARNING", **service_env},
    )
    stack.start()
    s = settings
    try:
        yield Endpoints(
            gateway=f"http://127.0.0.1:{s.gateway_port}",
            triton_grpc=f"127.0.0.1:{s.triton_grpc_port}",
            redis=f"redis://127.0.0.1:{s.redis_port}",
            mongo=stack.mongo_url,
            binder=f"http://127.0.0.1:{s.binder_port}",
            api_key=stack.api_key or "",
            stack=stack,
        )
    finally:
        stack.stop()


@contextlib.contextmanager
def lone_redis(name: str = "bench-redis") -> Iterator[str]:
    """A redis-server of its own (the stack's settings) in a temporary directory: its URL
    while the block runs, then stopped by its pid."""
    with tempfile.TemporaryDirectory() as data, services.lone_redis(Path(data), name) as url:
        yield url
