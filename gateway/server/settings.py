"""The gateway's settings (environment variables, see gateway.common.settings)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from gateway.common.settings import CommaList, ServiceSettings


class GatewaySettings(ServiceSettings):
    host: str = "127.0.0.1"
    port: int = 8080
    # Triton replicas, gRPC host:port each.
    triton_grpc_urls: CommaList = ["127.0.0.1:8001"]
    # Internal search endpoints of the binders (each holds a full copy of the index).
    binder_urls: CommaList = ["http://127.0.0.1:8090"]
    # The model registry (TOML); empty: the local profile's models.
    models_file: Path | None = None

    # -- HTTP -----------------------------------------------------------------------------
    max_body_bytes: int = Field(default=8 * 1024 * 1024, gt=0)
    # A client must send its request headers, and then its body, within these.
    header_timeout_s: float = Field(default=10.0, gt=0)
    body_timeout_s: float = Field(default=30.0, gt=0)
    keep_alive_s: float = Field(default=5.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    default_timeout_s: float = Field(default=300.0, gt=0)
    max_timeout_s: float = Field(default=3600.0, gt=0)
    # Upper bound for `Prefer: wait=N` and `?wait=N`.
    max_wait_s: float = Field(default=60.0, gt=0)
    idempotency_ttl_s: int = Field(default=24 * 3600, gt=0)
    sse_ping_s: float = Field(default=15.0, gt=0)

    # -- Admission ---------------------------------------------------------------------
    # Queued (not yet started) requests, and their payload bytes, beyond which
    # POST /infer answers 429.
    max_backlog: int = Field(default=1000, ge=1)
    max_backlog_bytes: int = Field(default=512 * 1024 * 1024, ge=1)

    # -- Replica pool -----------------------------------------------------------------------
    replica_max_inflight: int = Field(default=32, ge=1)
    probe_interval_s: float = Field(default=1.0, gt=0)
    probe_timeout_s: float = Field(default=2.0, gt=0)
    # A request that fails on a replica is tried again (elsewhere if possible) this often.
    max_retries: int = Field(default=3, ge=0)

    # -- Dispatcher ---------------------------------------------------------------------------
    # Requests read ahead of free slots and held locally (per model).
    dispatch_buffer: int = Field(default=16, ge=1)
    # A pending request idle this long belongs to a dead dispatcher and is reclaimed.
    claim_idle_ms: int = Field(default=15_000, ge=50)
    # A request started more often than this fails instead of being run again.
    max_deliveries: int = Field(default=3, ge=1)
    sweep_interval_s: float = Field(default=1.0, gt=0)
    # Token events: one per window, carrying every piece generated in it.
    token_window_ms: float = Field(default=10.0, ge=0)
    token_window_max: int = Field(default=16, ge=1)
    # How long a draining gateway lets running requests finish before handing them over.
    drain_s: float = Field(default=10.0, ge=0)
