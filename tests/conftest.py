"""Session fixtures: the real local stack (Triton from the pytriton wheel, Redis, the
MongoDB-wire server, a gateway and a binder), started once on free ports through the
same launcher `gateway up` uses, with tiny models built offline. Everything a test
starts is stopped by pid."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import tritonclient.grpc.aio as triton_aio
from pymongo import AsyncMongoClient

from gateway.stack.process import ManagedProcess, free_port
from gateway.stack.services import binder_spec, gateway_spec
from gateway.stack.settings import StackSettings
from gateway.stack.stack import LocalStack
from gateway.stack.weights import build_tiny_clip, build_tiny_gpt2

WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"

# Quick recovery and retries so failure tests finish in seconds.
SERVICE_ENV = {
    "CLAIM_IDLE_MS": "3000",
    "SWEEP_INTERVAL_S": "0.5",
    "PROBE_INTERVAL_S": "0.5",
    "SNAPSHOT_INTERVAL_S": "2",
    "WEBHOOK_SECRETS": WEBHOOK_SECRET,
    "WEBHOOK_ALLOWLIST": "127.0.0.1",
    "WEBHOOK_RETRY_SCHEDULE": "0,0.3,0.3,0.3",
    "WEBHOOK_JITTER": "0",
    "LOG_LEVEL": "INFO",
}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": build_tiny_gpt2(root / "tiny-gpt2"), "clip": build_tiny_clip(root / "tiny-clip")}


@dataclass
class Stack:
    launcher: LocalStack
    data_dir: Path
    extra: list[ManagedProcess] = field(default_factory=list)

    @property
    def s(self) -> StackSettings:
        return self.launcher.settings

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.s.redis_port}/0"

    def redis_db_url(self, db: int) -> str:
        return f"redis://127.0.0.1:{self.s.redis_port}/{db}"

    @property
    def mongo_url(self) -> str:
        return self.launcher.mongo_url

    @property
    def triton_grpc(self) -> str:
        return f"127.0.0.1:{self.s.triton_grpc_port}"

    @property
    def triton_http(self) -> str:
        return f"http://127.0.0.1:{self.s.triton_http_port}"

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.s.gateway_port}"

    @property
    def binder_url(self) -> str:
        return f"http://127.0.0.1:{self.s.binder_port}"

    def start(self, spec) -> ManagedProcess:
        """Start one more server for a test; stopped with the stack if the test does not."""
        process = ManagedProcess(spec)
        process.start()
        self.extra.append(process)
        process.wait_ready(time.monotonic() + 240)
        return process

    def start_gateway(self, name: str, ready_path: str = "/readyz", **env: str) -> tuple[ManagedProcess, str]:
        port = free_port()
        spec = gateway_spec(
            data_dir=self.data_dir,
            host="127.0.0.1",
            port=port,
            name=name,
            ready_path=ready_path,
            env={**self.launcher.service_env, **env},
        )
        return self.start(spec), f"http://127.0.0.1:{port}"

    def start_binder(self, name: str, **env: str) -> tuple[ManagedProcess, str]:
        port = free_port()
        spec = binder_spec(
            data_dir=self.data_dir, host="127.0.0.1", port=port, name=name, env={**self.launcher.service_env, **env}
        )
        return self.start(spec), f"http://127.0.0.1:{port}"

    def start_triton(self, name: str) -> tuple[ManagedProcess, str]:
        spec = self.launcher.triton(name, http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        process = self.start(spec)
        grpc_port = next(port for port, label in spec.ports if label == "Triton gRPC")
        return process, f"127.0.0.1:{grpc_port}"

    def stop(self, process: ManagedProcess) -> None:
        process.stop()
        if process in self.extra:
            self.extra.remove(process)


def kill_by_pid(process: ManagedProcess) -> None:
    """SIGKILL, as a crash would; the process's own children too."""
    children = process.descendants()
    os.kill(process.pid, signal.SIGKILL)
    process.popen.wait(10)
    for child in children:
        try:
            child.kill()
        except Exception:
            pass


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("stack")
    settings = StackSettings(
        data_dir=data_dir,
        triton_http_port=free_port(),
        triton_grpc_port=free_port(),
        triton_metrics_port=free_port(),
        redis_port=free_port(),
        mongo_port=free_port(),
        gateway_port=free_port(),
        binder_port=free_port(),
        llm_model=str(tiny_models["gpt2"]),
        clip_model=str(tiny_models["clip"]),
        allow_downloads=False,
    )
    launcher = LocalStack(settings, log=lambda line: print(line, file=sys.stderr), service_overrides=SERVICE_ENV)
    handle = Stack(launcher=launcher, data_dir=data_dir)
    launcher.start()
    try:
        yield handle
    finally:
        for process in reversed(handle.extra):
            process.stop()
        launcher.stop()


@pytest_asyncio.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60) as client:
        yield client


@pytest_asyncio.fixture
async def triton(stack: Stack) -> AsyncIterator[triton_aio.InferenceServerClient]:
    client = triton_aio.InferenceServerClient(stack.triton_grpc)
    yield client
    await client.close()


@pytest_asyncio.fixture
async def redis(stack: Stack) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(stack.redis_url, decode_responses=True)
    yield client
    await client.aclose()


@pytest_asyncio.fixture
async def mongo(stack: Stack) -> AsyncIterator[AsyncMongoClient]:
    client: AsyncMongoClient = AsyncMongoClient(stack.mongo_url, tz_aware=True)
    yield client
    await client.close()
