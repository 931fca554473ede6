"""Write compose/docker-compose.yml from compose/deployment.toml.

Compose has no loops, and each Triton replica needs its own GPU(s), so the Triton services
are generated: changing the replica count is one edit (the `gpus` list in deployment.toml)
followed by `gateway model-repo compose`. The same run writes the gateway's
TRITON_GRPC_URLS and BINDER_URLS, so those lists always name every replica. A test checks
that the committed docker-compose.yml is what deployment.toml generates.

nginx reaches the replicas through network aliases shared by all of them (`gateway`,
`triton`): Docker's DNS answers with every replica's address, so nginx.conf never lists
replicas and needs no change when their number does.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from gateway.deploy import REPO_ROOT, ToolError
from gateway.deploy.engines import NGC_CONTAINER

COMPOSE_DIR = REPO_ROOT / "compose"
DEPLOYMENT_FILE = COMPOSE_DIR / "deployment.toml"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"

TRITON_GRPC_PORT = 8001
TRITON_HTTP_PORT = 8000
GATEWAY_PORT = 8080
BINDER_PORT = 8090
TRITON_METRICS_PORT = 8002
PROMETHEUS_PORT = 9090
GRAFANA_PORT = 3000
# Prometheus and Grafana start only with `docker compose --profile observability up`.
OBSERVABILITY_PROFILE = "observability"
LLM_MODEL_NAME = "trtllm_tensorrt_llm"

HEADER = """\
# Production deployment: Triton replicas (one GPU, or tensor_parallel_size GPUs, each),
# Redis (AOF), MongoDB (single-node replica set), gateways, binders and nginx; with
# `--profile observability`, Prometheus and Grafana (compose/prometheus, compose/grafana).
#
# GENERATED from compose/deployment.toml by `gateway model-repo compose`: edit that file
# (e.g. the list of GPUs) and run the command again rather than editing this one.
# Settings that are not about the number of replicas come from compose/.env
# (copy compose/.env.example). docs/deployment.md walks through a first start.
"""


@dataclass(frozen=True)
class Deployment:
    gpus: tuple[str, ...]
    tensor_parallel_size: int = 1
    gateway_replicas: int = 2
    binders: int = 2
    # Publish Triton's gRPC API through nginx for clients that call Triton directly.
    # Off by default: Triton has no authentication, so it stays inside the network.
    publish_triton_grpc: bool = False

    def __post_init__(self) -> None:
        if not self.gpus:
            raise ToolError("deployment: gpus must name at least one GPU")
        if len(set(self.gpus)) != len(self.gpus):
            raise ToolError(f"deployment: a GPU is listed twice in gpus {list(self.gpus)}")
        if self.tensor_parallel_size < 1 or len(self.gpus) % self.tensor_parallel_size:
            raise ToolError(
                f"deployment: {len(self.gpus)} GPUs do not split into replicas of "
                f"tensor_parallel_size={self.tensor_parallel_size}"
            )
        if self.gateway_replicas < 1 or self.binders < 1:
            raise ToolError("deployment: gateway_replicas and binders must be at least 1")

    @classmethod
    def load(cls, path: Path = DEPLOYMENT_FILE) -> Deployment:
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ToolError(f"{path}: {exc}") from None
        known = {"gpus", "tensor_parallel_size", "gateway_replicas", "binders", "publish_triton_grpc"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ToolError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "gpus" not in data:
            raise ToolError(f"{path}: missing required key gpus")
        return cls(
            gpus=tuple(str(g) for g in data["gpus"]),
            tensor_parallel_size=int(data.get("tensor_parallel_size", 1)),
            gateway_replicas=int(data.get("gateway_replicas", 2)),
            binders=int(data.get("binders", 2)),
            publish_triton_grpc=bool(data.get("publish_triton_grpc", False)),
        )

    @property
    def replica_gpus(self) -> list[tuple[str, ...]]:
        tp = self.tensor_parallel_size
        return [self.gpus[i : i + tp] for i in range(0, len(self.gpus), tp)]


def triton_name(index: int) -> str:
    return f"triton-{index}"


def binder_name(index: int) -> str:
    return f"binder-{index}"


def _tritonserver(rank: int, tp_size: int) -> list[str]:
    argv = [
        "tritonserver",
        "--model-repository=/models",
        f"--http-port={TRITON_HTTP_PORT}",
        f"--grpc-port={TRITON_GRPC_PORT}",
        f"--metrics-port={TRITON_METRICS_PORT}",
        "--disable-auto-complete-config",
        # Each MPI rank's python backend needs its own shared-memory names.
        f"--backend-config=python,shm-region-prefix-name=prefix{rank}_",
    ]
    if rank > 0:
        # Ranks past the first only serve their shard of the engine (tensorrtllm leader mode).
        argv += ["--model-control-mode=explicit", f"--load-model={LLM_MODEL_NAME}"]
    return argv


def triton_command(tp_size: int) -> list[str]:
    if tp_size == 1:
        return _tritonserver(0, 1)
    # Tensor parallelism: one tritonserver per GPU under MPI, as tensorrtllm_backend's
    # launch_triton_server.py starts them.
    argv = ["mpirun", "--allow-run-as-root"]
    for rank in range(tp_size):
        if rank:
            argv.append(":")
        argv += ["-n", "1", *_tritonserver(rank, tp_size)]
    return argv


def _http_check(url: str) -> list[str]:
    # Python is in every image used here (curl is not in python:3.11-slim); urlopen raises
    # on anything but 2xx, which exits non-zero.
    return ["CMD", "python3", "-c", f"import urllib.request; urllib.request.urlopen('{url}', timeout=4)"]


def _triton(index: int, gpus: tuple[str, ...], tp_size: int) -> dict[str, Any]:
    return {
        "image": f"${{TRITON_IMAGE:-{NGC_CONTAINER}}}",
        "command": triton_command(tp_size),
        # The python backend passes tensors through /dev/shm; Docker's 64 MB is far too small.
        "shm_size": "${TRITON_SHM_SIZE:-4g}",
        "ulimits": {"memlock": -1, "stack": 67108864},
        "volumes": [
            "${MODEL_REPO_DIR:?set MODEL_REPO_DIR in compose/.env}:/models:ro",
            "${ENGINES_DIR:?set ENGINES_DIR in compose/.env}:/engines:ro",
            "${HF_DIR:?set HF_DIR in compose/.env}:/hf:ro",
        ],
        "deploy": {
            "resources": {
                "reservations": {"devices": [{"driver": "nvidia", "device_ids": list(gpus), "capabilities": ["gpu"]}]}
            }
        },
        "healthcheck": {
            "test": _http_check(f"http://localhost:{TRITON_HTTP_PORT}/v2/health/ready"),
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            # Loading engines and tokenizers takes minutes on a cold start.
            "start_period": "600s",
        },
        "networks": {"default": {"aliases": ["triton"]}},
        "restart": "unless-stopped",
    }


# Redis and MongoDB share the network with Triton and the binders: each needs its password
# (compose/.env; hex, so that it goes into a URL as it is).
REDIS_PASSWORD = "${REDIS_PASSWORD:?set REDIS_PASSWORD in compose/.env}"
MONGO_USERNAME = "${MONGO_USERNAME:-gateway}"
MONGO_PASSWORD = "${MONGO_PASSWORD:?set MONGO_PASSWORD in compose/.env}"
# The binders' internal API (search, webhook and dead-letter replay): the gateways send it.
BINDER_API_KEY = "${BINDER_API_KEY:?set BINDER_API_KEY in compose/.env}"
# mongod with authentication and a replica set needs a key file: derived from the password
# at start (only the root user's password opens it anyway), readable by mongod's user only.
MONGO_KEY_FILE = "/tmp/mongo-keyfile"
_MONGO_ENTRYPOINT = (
    f"printf '%s' \"$$MONGO_INITDB_ROOT_PASSWORD\" | sha256sum | cut -c1-64 > {MONGO_KEY_FILE} && "
    f'chmod 400 {MONGO_KEY_FILE} && chown 999:999 {MONGO_KEY_FILE} && exec docker-entrypoint.sh "$$@"'
)


def _service_env() -> dict[str, str]:
    return {
        "REDIS_URL": f"redis://:{REDIS_PASSWORD}@redis:6379/0",
        "MONGO_URL": f"mongodb://{MONGO_USERNAME}:{MONGO_PASSWORD}@mongo:27017/?replicaSet=rs0&authSource=admin",
        "BINDER_API_KEY": BINDER_API_KEY,
        # The binders sign each tenant's webhooks with a secret derived from these; the
        # gateways derive the same to show a tenant's admin its own.
        "WEBHOOK_SECRETS": "${WEBHOOK_SECRETS:?set WEBHOOK_SECRETS in compose/.env}",
        "LOG_FORMAT": "json",
        "LOG_LEVEL": "${LOG_LEVEL:-INFO}",
    }


def generate(deployment: Deployment) -> dict[str, Any]:
    replicas = deployment.replica_gpus
    triton_urls = ",".join(f"{triton_name(i)}:{TRITON_GRPC_PORT}" for i in range(len(replicas)))
    binder_urls = ",".join(f"http://{binder_name(i)}:{BINDER_PORT}" for i in range(deployment.binders))
    app_image = "${GATEWAY_IMAGE:-triton-gateway:latest}"
    backing = {"redis": {"condition": "service_healthy"}, "mongo": {"condition": "service_healthy"}}

    services: dict[str, Any] = {}
    for index, gpus in enumerate(replicas):
        services[triton_name(index)] = _triton(index, gpus, deployment.tensor_parallel_size)
    services["redis"] = {
        "image": "${REDIS_IMAGE:-redis:7.2-alpine}",
        # Accepted requests live in Redis streams until stored: AOF, fsync every second.
        "command": [
            "redis-server",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            # A bound, and never evict: past it new work is refused (503 redis_full), what
            # was accepted stays.
            "--maxmemory",
            "${REDIS_MAXMEMORY:-4gb}",
            "--maxmemory-policy",
            "noeviction",
            "--requirepass",
            REDIS_PASSWORD,
        ],
        # redis-cli (the health check) reads the password from REDISCLI_AUTH.
        "environment": {"REDISCLI_AUTH": REDIS_PASSWORD},
        "volumes": ["redis-data:/data"],
        "healthcheck": {"test": ["CMD", "redis-cli", "ping"], "interval": "5s", "timeout": "3s", "retries": 5},
        "restart": "unless-stopped",
    }
    services["mongo"] = {
        "image": "${MONGO_IMAGE:-mongo:7.0}",
        # A single-node replica set: retryable writes and change streams need one. With
        # authentication: the root user is made on the first start of an empty volume.
        "entrypoint": ["bash", "-ec", _MONGO_ENTRYPOINT, "mongo"],
        "command": ["mongod", "--replSet", "rs0", "--bind_ip_all", "--keyFile", MONGO_KEY_FILE],
        "environment": {"MONGO_INITDB_ROOT_USERNAME": MONGO_USERNAME, "MONGO_INITDB_ROOT_PASSWORD": MONGO_PASSWORD},
        "volumes": ["mongo-data:/data/db", "./mongo/init-replica-set.js:/scripts/init-replica-set.js:ro"],
        # The health check initiates the replica set once, then reports healthy when primary.
        "healthcheck": {
            "test": [
                "CMD-SHELL",
                'mongosh --quiet --norc -u "$$MONGO_INITDB_ROOT_USERNAME" -p "$$MONGO_INITDB_ROOT_PASSWORD" '
                "--authenticationDatabase admin /scripts/init-replica-set.js",
            ],
            "interval": "5s",
            "timeout": "10s",
            "retries": 10,
            "start_period": "20s",
        },
        "restart": "unless-stopped",
    }
    services["gateway"] = {
        "image": app_image,
        "build": {"context": "..", "dockerfile": "Dockerfile"},
        "command": ["gateway", "serve"],
        "environment": {
            "HOST": "0.0.0.0",
            "PORT": str(GATEWAY_PORT),
            **_service_env(),
            "TRITON_GRPC_URLS": triton_urls,
            "BINDER_URLS": binder_urls,
        },
        "deploy": {"replicas": deployment.gateway_replicas},
        "depends_on": backing,
        "healthcheck": {
            "test": _http_check(f"http://localhost:{GATEWAY_PORT}/healthz"),
            "interval": "10s",
            "timeout": "5s",
            "retries": 3,
            "start_period": "20s",
        },
        "restart": "unless-stopped",
    }
    for index in range(deployment.binders):
        services[binder_name(index)] = {
            "image": app_image,
            # Same image as the gateway; a build section here too so that compose never
            # tries to pull the locally built tag.
            "build": {"context": "..", "dockerfile": "Dockerfile"},
            "command": ["binder", "run"],
            "environment": {
                "BINDER_HOST": "0.0.0.0",
                "BINDER_PORT": str(BINDER_PORT),
                # A stable consumer name: after a restart the binder takes back its own pending entries.
                "BINDER_NAME": binder_name(index),
                "FAISS_DIR": "/data/faiss",
                **_service_env(),
            },
            "volumes": [f"{binder_name(index)}-faiss:/data/faiss"],
            # One name for every binder, as `triton` for the replicas: Prometheus finds them by it.
            "networks": {"default": {"aliases": ["binder"]}},
            "depends_on": backing,
            "healthcheck": {
                "test": _http_check(f"http://localhost:{BINDER_PORT}/healthz"),
                "interval": "10s",
                "timeout": "5s",
                "retries": 3,
                "start_period": "20s",
            },
            "restart": "unless-stopped",
        }
    services["nginx"] = {
        "image": "${NGINX_IMAGE:-nginx:1.28-alpine}",
        "volumes": ["../nginx/nginx.conf:/etc/nginx/nginx.conf:ro"],
        "ports": ["${NGINX_HTTP_PORT:-80}:80"]
        + (["${NGINX_GRPC_PORT:-8001}:8001"] if deployment.publish_triton_grpc else []),
        # nginx resolves `gateway` and `triton` when it starts: they must exist by then.
        "depends_on": {
            "gateway": {"condition": "service_healthy"},
            **{triton_name(i): {"condition": "service_started"} for i in range(len(replicas))},
        },
        "healthcheck": {
            "test": ["CMD", "wget", "-q", "-O", "/dev/null", "http://127.0.0.1/health"],
            "interval": "10s",
            "timeout": "3s",
            "retries": 3,
        },
        "restart": "unless-stopped",
    }
    services |= _observability()
    volumes: dict[str, dict[str, Any]] = {"redis-data": {}, "mongo-data": {}}
    volumes |= {f"{binder_name(i)}-faiss": {} for i in range(deployment.binders)}
    volumes |= {"prometheus-data": {}, "grafana-data": {}}
    return {"name": "triton-gateway", "services": services, "volumes": volumes}


def _observability() -> dict[str, Any]:
    """Prometheus (scraping gateways, binders and Triton by their DNS names, so its
    config does not change with the replica count) and Grafana with the dashboard
    provisioned. Both listen on the host's loopback only: Prometheus has no
    authentication, and Grafana starts with the admin password from compose/.env."""
    return {
        "prometheus": {
            "image": "${PROMETHEUS_IMAGE:-prom/prometheus:v3.5.0}",
            "profiles": [OBSERVABILITY_PROFILE],
            "command": [
                "--config.file=/etc/prometheus/prometheus.yml",
                "--storage.tsdb.path=/prometheus",
                "--storage.tsdb.retention.time=${PROMETHEUS_RETENTION:-15d}",
            ],
            "volumes": [
                "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro",
                "prometheus-data:/prometheus",
            ],
            "ports": [f"127.0.0.1:${{PROMETHEUS_PORT:-{PROMETHEUS_PORT}}}:{PROMETHEUS_PORT}"],
            "healthcheck": {
                "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready"],
                "interval": "10s",
                "timeout": "3s",
                "retries": 3,
            },
            "restart": "unless-stopped",
        },
        "grafana": {
            "image": "${GRAFANA_IMAGE:-grafana/grafana:12.1.0}",
            "profiles": [OBSERVABILITY_PROFILE],
            "environment": {
                "GF_SECURITY_ADMIN_PASSWORD": "${GRAFANA_ADMIN_PASSWORD:-admin}",
                "GF_USERS_ALLOW_SIGN_UP": "false",
            },
            "volumes": [
                "./grafana/provisioning:/etc/grafana/provisioning:ro",
                "./grafana/dashboards:/var/lib/grafana/dashboards:ro",
                "grafana-data:/var/lib/grafana",
            ],
            "ports": [f"127.0.0.1:${{GRAFANA_PORT:-{GRAFANA_PORT}}}:{GRAFANA_PORT}"],
            "depends_on": {"prometheus": {"condition": "service_started"}},
            "healthcheck": {
                "test": ["CMD", "wget", "-q", "-O", "/dev/null", f"http://127.0.0.1:{GRAFANA_PORT}/api/health"],
                "interval": "10s",
                "timeout": "3s",
                "retries": 3,
            },
            "restart": "unless-stopped",
        },
    }


def dump(deployment: Deployment) -> str:
    body = yaml.safe_dump(generate(deployment), sort_keys=False, default_flow_style=False, width=100)
    return HEADER + "\n" + body


def write(deployment_file: Path = DEPLOYMENT_FILE, out: Path = COMPOSE_FILE) -> Path:
    out.write_text(dump(Deployment.load(deployment_file)))
    return out
