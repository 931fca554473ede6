"""The local stack's settings (`gateway up`): STACK_* environment variables or flags."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from gateway.assets import model_repo


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
    llm_model: str = "gpt2-medium"
    clip_model: str = "openai/clip-vit-base-patch32"
    # Try to download weights missing from the local Hugging Face cache.
    allow_downloads: bool = Field(default_factory=lambda: os.environ.get("HF_HUB_OFFLINE", "0") in ("", "0"))
    model_repo: Path = Field(default_factory=lambda: model_repo() / "local")
    start_gateway: bool = True
    start_binder: bool = True
    startup_timeout_s: float = 300.0
