"""Settings, read from the environment (and an optional `.env` file) by pydantic-settings.

One class per process role. Names are the environment variables in upper case, e.g.
`redis_url` is `REDIS_URL`. Lists accept either JSON or a comma-separated string.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, Field
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


def _split_commas(value: object) -> object:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


# A list from the environment: JSON, or "a,b,c".
CommaList = Annotated[list[str], NoDecode, BeforeValidator(_split_commas)]


class ServiceSettings(BaseSettings):
    """What every long-running process (gateway, binder) needs."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    mongo_url: str = "mongodb://127.0.0.1:27017"
    mongo_db: str = "triton_gateway"
    # How long a stored result is kept in MongoDB (TTL index on expires_at).
    result_retention_s: int = Field(default=7 * 24 * 3600, gt=0)
    # How long Redis keeps a request's live state and event stream after it ends.
    live_state_ttl_s: int = Field(default=24 * 3600, gt=0)
    log_level: str = "INFO"
    log_format: Literal["console", "json"] = "console"


class GatewaySettings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8080
    # Triton replicas, gRPC host:port each.
    triton_grpc_urls: CommaList = ["127.0.0.1:8001"]
    # Internal search endpoints of the binders (each holds a full copy of the index).
    binder_urls: CommaList = ["http://127.0.0.1:8090"]

    max_body_bytes: int = 8 * 1024 * 1024
    # Queued (not yet started) requests beyond which POST /infer answers 429.
    max_backlog: int = 1000
    retry_after_s: int = 1
    default_timeout_s: float = 300.0
    max_timeout_s: float = 3600.0
    # Upper bound for `Prefer: wait=N` and `?wait=N`.
    max_wait_s: float = 60.0
    idempotency_ttl_s: int = 24 * 3600

    # Replica pool.
    replica_max_inflight: int = 32
    probe_interval_s: float = 1.0
    probe_timeout_s: float = 2.0

    # Dispatcher (consumer group on the requests stream).
    dispatch_batch: int = 32
    # A pending request idle this long belongs to a dead consumer and is reclaimed.
    claim_idle_ms: int = 15_000
    # A request reclaimed more often than this fails instead of being run again.
    max_deliveries: int = 3
    events_maxlen: int = 4096
    sweep_interval_s: float = 1.0

    sse_ping_s: float = 15.0


class BinderSettings(ServiceSettings):
    binder_host: str = "127.0.0.1"
    binder_port: int = 8090
    # Consumer name in the binders group; must be unique per running binder.
    binder_name: str = Field(default_factory=lambda: f"binder-{os.uname().nodename}-{os.getpid()}")
    batch_size: int = 256
    block_ms: int = 200
    # After a short read, wait this long for more before writing: MongoDB (and nx-27017
    # most of all) stores a few large batches far more cheaply than many small ones.
    linger_ms: int = 50
    claim_idle_ms: int = 30_000
    # An entry delivered more often than this goes to the dead-letter stream.
    max_deliveries: int = 5
    faiss_dir: Path = Path(".stack/faiss")
    snapshot_interval_s: float = 30.0
    # Webhooks (Standard Webhooks): one or more `whsec_...` secrets, newest first.
    webhook_secrets: CommaList = []
    # Seconds before each attempt (Svix-like); the first is the initial delivery.
    webhook_retry_schedule: CommaList = ["0", "5", "300", "1800", "7200", "18000", "36000", "36000"]
    webhook_jitter: float = 0.1
    webhook_timeout_s: float = 15.0
    webhook_concurrency: int = 64
    # Hosts, IPs or CIDRs allowed even though they are not public addresses.
    webhook_allowlist: CommaList = []

    @property
    def retry_delays(self) -> list[float]:
        return [float(x) for x in self.webhook_retry_schedule]


class StackSettings(BaseSettings):
    """The local stack that `gateway up` starts."""

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
    llm_model: str = "gpt2-medium"
    clip_model: str = "openai/clip-vit-base-patch32"
    # Try to download weights missing from the local Hugging Face cache.
    allow_downloads: bool = Field(default_factory=lambda: os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0"))
    model_repo: Path = Path(__file__).resolve().parent.parent / "model_repo" / "local"
    start_gateway: bool = True
    start_binder: bool = True
    startup_timeout_s: float = 300.0
