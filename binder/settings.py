"""The binder's settings (environment variables, see gateway.common.settings)."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field

from gateway.common.settings import CommaList, ServiceSettings


class BinderSettings(ServiceSettings):
    binder_host: str = "127.0.0.1"
    binder_port: int = 8090
    # Consumer name in the binders group; must be unique per running binder.
    binder_name: str = Field(default_factory=lambda: f"binder-{os.uname().nodename}-{os.getpid()}")
    batch_size: int = Field(default=256, ge=1)
    block_ms: int = Field(default=200, ge=1, le=1500)
    # After a short read, wait this long for more before writing: MongoDB (and nx-27017
    # most of all) stores a few large batches far more cheaply than many small ones.
    linger_ms: int = Field(default=50, ge=0)
    claim_idle_ms: int = Field(default=30_000, ge=50)
    # An entry delivered more often than this goes to the dead-letter stream.
    max_deliveries: int = Field(default=5, ge=1)
    faiss_dir: Path = Path(".stack/faiss")
    snapshot_interval_s: float = Field(default=30.0, gt=0)
    # Webhooks (Standard Webhooks): one or more `whsec_...` secrets, newest first.
    webhook_secrets: CommaList = []
    # Seconds before each attempt (Svix-like); the first is the initial delivery.
    webhook_retry_schedule: CommaList = ["0", "5", "300", "1800", "7200", "18000", "36000", "36000"]
    webhook_jitter: float = Field(default=0.1, ge=0, le=1)
    webhook_timeout_s: float = Field(default=15.0, gt=0)
    webhook_concurrency: int = Field(default=64, ge=1)
    # Hosts, IPs or CIDRs allowed even though they are not public addresses.
    webhook_allowlist: CommaList = []

    @property
    def retry_delays(self) -> list[float]:
        return [float(x) for x in self.webhook_retry_schedule]
