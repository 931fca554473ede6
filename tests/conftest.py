"""Session fixtures: the real local stack (Triton from the pytriton wheel, Redis, the
MongoDB-wire server, a gateway and a binder), started once on free ports through the
same launcher `gateway up` uses, with tiny models built offline. Everything a test
starts is stopped by pid, with its whole process tree and Triton's shared memory; the
session fails if any process or /dev/shm region it started is left at the end."""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import tritonclient.grpc.aio as triton_aio
from pymongo import AsyncMongoClient

from gateway.protocol.webhook_secrets import tenant_secret
from gateway.server.queue.jobs import JobStore
from gateway.stack import services
from gateway.stack.owners import TAG_ENV, TRITON_SHM_PREFIX, owned_processes, remove_shm, shm_regions
from gateway.stack.process import ManagedProcess, free_port, stop_processes
from gateway.stack.services import binder_spec, gateway_spec
from gateway.stack.settings import StackSettings
from gateway.stack.stack import LocalStack
from gateway.stack.weights import build_tiny_clip, build_tiny_gpt2

WEBHOOK_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"


def webhook_secret_of(tenant: str) -> str:
    """What verifies the webhooks of a tenant without secrets of its own in the test stack:
    its secret derived from WEBHOOK_SECRET, as the binder signs and the gateway shows it."""
    return tenant_secret(WEBHOOK_SECRET, tenant)


# Quick recovery and retries so failure tests finish in seconds.
class _Auth(Mapping[str, str]):
    """`Authorization: Bearer <the session stack's key>` (read when used: the key is made
    when the stack starts, and pytest may import this module twice)."""

    def _headers(self) -> dict[str, str]:
        key = os.environ.get("GATEWAY_API_KEY", "")
        return {"Authorization": f"Bearer {key}"} if key else {}

    def __getitem__(self, name: str) -> str:
        return self._headers()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._headers())

    def __len__(self) -> int:
        return len(self._headers())


AUTH = _Auth()

SERVICE_ENV = {
    # The docs pages (CDN scripts) are off by default; the tests of /docs need them.
    "DOCS_UI": "true",
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


def pytest_configure(config: pytest.Config) -> None:
    # Every process this session starts (in-process stacks and `gateway up` runs alike)
    # carries this tag in its owner token, and so do its Tritons' shared-memory regions.
    # Nested in an outer run's tag, so that run still sees what this one leaves.
    os.environ[TAG_ENV] = os.environ.get(TAG_ENV, "") + f"t{secrets.token_hex(4)}-"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a process or a Triton /dev/shm region it started is left."""
    tag = os.environ[TAG_ENV]
    deadline = time.monotonic() + 10  # a killed launcher's guard may still be cleaning up
    while (owned_processes(tag) or shm_regions(TRITON_SHM_PREFIX + tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    processes = owned_processes(tag)
    regions = [path.name for path in shm_regions(TRITON_SHM_PREFIX + tag)]
    if processes or regions:
        for proc in processes:
            try:
                proc.kill()  # ours by the tag: not left to the next run
            except Exception:
                pass
        remove_shm(TRITON_SHM_PREFIX + tag)
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.ensure_newline()
            pids = [proc.pid for proc in processes]
            reporter.write_line(f"LEFT BEHIND by this test run: pids {pids}, /dev/shm {regions}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"gpt2": build_tiny_gpt2(root / "tiny-gpt2"), "clip": build_tiny_clip(root / "tiny-clip")}


@dataclass
class Stack:
    launcher: LocalStack
    data_dir: Path
    extra: list[ManagedProcess] = field(default_factory=list)
    metrics_ports: dict[str, int] = field(default_factory=dict)  # extra Triton gRPC URL -> metrics port

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
    def api_key(self) -> str:
        return self.launcher.api_key or ""

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
        metrics_port = free_port()
        spec = self.launcher.triton(name, http_port=free_port(), grpc_port=free_port(), metrics_port=metrics_port)
        process = self.start(spec)
        grpc_port = next(port for port, label in spec.ports if label == "Triton gRPC")
        self.metrics_ports[f"127.0.0.1:{grpc_port}"] = metrics_port
        return process, f"127.0.0.1:{grpc_port}"

    def replicas_env(self, *grpc_urls: str) -> dict[str, str]:
        """TRITON_GRPC_URLS and the matching TRITON_METRICS_URLS for a gateway."""
        ports = {self.triton_grpc: self.s.triton_metrics_port, **self.metrics_ports}
        return {
            "TRITON_GRPC_URLS": ",".join(grpc_urls),
            "TRITON_METRICS_URLS": ",".join(f"http://127.0.0.1:{ports[url]}/metrics" for url in grpc_urls),
        }

    def stop(self, process: ManagedProcess, grace: float | None = None) -> None:
        """SIGTERM; SIGKILL after `grace` seconds (the stack's default when None)."""
        if grace is None:
            process.stop()
        else:
            process.stop(grace)
        if process in self.extra:
            self.extra.remove(process)


@contextmanager
def lone_redis(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[str]:
    """A redis-server of its own, without the stack (tests of the script layer): its URL
    while the block runs, then stopped by its pid."""
    with services.lone_redis(tmp_path_factory.mktemp(name), name) as url:
        yield url


@pytest.fixture(scope="module")
def redis_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of the test module's own (tests of the script layer), by its URL."""
    name = request.module.__name__.rpartition(".")[2].removeprefix("test_").replace("_", "-")
    with lone_redis(tmp_path_factory, f"{name}-redis") as url:
        yield url


@pytest.fixture
async def store(redis_server: str) -> AsyncIterator[JobStore]:
    """A JobStore on the module's redis-server, emptied before each test."""
    client = aioredis.from_url(redis_server, decode_responses=True)
    await client.flushdb()
    yield JobStore(client, idempotency_ttl_s=60, lease_ms=10_000)
    await client.aclose()


def kill_by_pid(process: ManagedProcess) -> None:
    """SIGKILL, as a crash would; then what it left (its children, Triton's stubs and
    shared memory) is cleaned up the way the launcher does after a crash."""
    process.kill()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("stack")
    settings = StackSettings.on_free_ports(
        data_dir=data_dir,
        llm_model=str(tiny_models["gpt2"]),
        clip_model=str(tiny_models["clip"]),
        allow_downloads=False,
    )
    launcher = LocalStack(settings, log=lambda line: print(line, file=sys.stderr), service_overrides=SERVICE_ENV)
    handle = Stack(launcher=launcher, data_dir=data_dir)
    launcher.start()
    # The stack's API key (made by the launcher): every client of this run uses it.
    os.environ["GATEWAY_API_KEY"] = launcher.api_key or ""
    try:
        yield handle
    finally:
        stop_processes(handle.extra)  # all at once, whole trees and shared memory
        launcher.stop()


@pytest_asyncio.fixture
async def http(stack: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60, headers=AUTH) as client:
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
