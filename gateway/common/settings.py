"""Settings common to the server roles (gateway, binder), read from the environment
(and an optional `.env` file) by pydantic-settings. Each role has its own class holding
only what it reads; names are the environment variables in upper case."""

from __future__ import annotations

import ipaddress
import json
import zlib
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
    """What every long-running server process needs: where Redis and MongoDB are."""

    model_config = SettingsConfigDict(env_file=".env", extra="ignore")

    redis_url: str = "redis://127.0.0.1:6379/0"
    # Redis Cluster: its nodes (host:port, any of them); then REDIS_URL is not used.
    redis_cluster_nodes: CommaList = []
    # Requests are spread over this many shards by tenant (each shard one hash tag, so one
    # Cluster slot). Every process of a deployment must use the same number.
    redis_shards: int = Field(default=1, ge=1, le=1024)
    # The FAISS index split by tenant over binders: this many partitions (1: every binder
    # holds the whole index). A binder holds INDEX_PARTITION (binder settings); the
    # gateways' BINDER_URLS list the binders in order, the i-th holding partition
    # i % INDEX_PARTITIONS. Every process of a deployment must use the same number.
    index_partitions: int = Field(default=1, ge=1, le=1024)
    # A Redis that stops answering fails a call after this long instead of hanging it.
    redis_timeout_s: float = Field(default=5.0, gt=0)
    redis_max_connections: int = Field(default=256, ge=8)
    # Durability across a failover: a submission is acknowledged (and a finish recorded)
    # once this many replicas confirmed the write (WAIT), within REDIS_WAIT_TIMEOUT_MS;
    # fewer in time refuses the submission (503 not_replicated). 0: no WAIT (one Redis
    # without replicas; acknowledged then means written to the primary).
    redis_wait_replicas: int = Field(default=0, ge=0, le=16)
    redis_wait_timeout_ms: int = Field(default=250, ge=1, le=60_000)
    # One Redis: the script calls of one turn of the event loop go as one pipeline (group
    # commit, gateway/common/redis.py). False: each call its own round trip.
    redis_group_commit: bool = True
    mongo_url: str = "mongodb://127.0.0.1:27017"
    mongo_db: str = "triton_gateway"
    mongo_timeout_s: float = Field(default=5.0, gt=0)
    # How long a stored result is kept in MongoDB (TTL index on expires_at).
    result_retention_s: int = Field(default=7 * 24 * 3600, gt=0)
    # How long Redis keeps the live state and event stream of a request whose result the
    # binder could not store (dead-lettered; a stored one goes RESULTS_KEEP_S after it was
    # stored; one not yet stored stays until it is).
    live_state_ttl_s: int = Field(default=24 * 3600, gt=0)
    log_level: str = "INFO"
    log_format: Literal["console", "json"] = "console"


def is_loopback(host: str) -> bool:
    """Whether an address (a bind address or a peer's) is this machine's loopback only:
    0.0.0.0, :: and names other than localhost are not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def index_partition(tenant: str, partitions: int) -> int:
    """The FAISS index partition that holds a tenant's vectors (INDEX_PARTITIONS)."""
    return zlib.crc32(b"index:" + tenant.encode()) % max(1, partitions)
