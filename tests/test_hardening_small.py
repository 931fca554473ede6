"""Smaller hardening (issue 53, item 7), each checked at its cause without the stack: the
access log prints the path as sent (a %0A forges no line), /metrics names replicas as
records do (never host:port), a webhook refusal never tells what an internal host
resolves to."""

from __future__ import annotations

import logging
from ipaddress import ip_address
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.responses import PlainTextResponse
from starlette.types import Receive, Scope, Send

from binder.webhooks.guard import AddressGuard, Refused
from gateway.deploy.compose import COMPOSE_FILE
from gateway.protocol.records import replica_name
from gateway.server.api.edge import Edge
from gateway.server.api.errors import ErrorRenderer
from gateway.server.app import create_app
from gateway.server.dispatch.sweeper import Sweeper
from gateway.server.metrics import GatewayMetrics
from gateway.server.settings import GatewaySettings

# -- access log -------------------------------------------------------------------------


async def _not_found(scope: Scope, receive: Receive, send: Send) -> None:
    await PlainTextResponse("no", status_code=404)(scope, receive, send)


async def test_access_log_prints_the_path_as_sent_so_an_encoded_newline_forges_no_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = SimpleNamespace(settings=GatewaySettings(_env_file=None))  # type: ignore[call-arg]
    edge = Edge(
        _not_found,
        metrics=GatewayMetrics(),
        errors=ErrorRenderer(),
        max_bytes=1024,
        body_timeout_s=5,
        services=lambda: settings,  # type: ignore[arg-type,return-value]
    )
    forged = "/ui/x%0D%0AGET%20/admin/tenants%20200%201.0ms%1B[2J"
    transport = httpx.ASGITransport(app=edge)
    with caplog.at_level(logging.INFO, logger="gateway.access"):
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
            assert (await client.get(forged)).status_code == 404
    [line] = [record.getMessage() for record in caplog.records if record.name == "gateway.access"]
    assert line.startswith(f"GET {forged} 404 "), line
    assert "\n" not in line and "\r" not in line and "\x1b" not in line


# -- /metrics replica labels ------------------------------------------------------------


async def test_metrics_label_replicas_by_name_never_by_address() -> None:
    urls = ["10.20.30.40:8001", "triton-1.triton.svc:8001"]
    pool = SimpleNamespace(replicas=[SimpleNamespace(url=url, healthy=True, inflight=3) for url in urls])
    metrics = GatewayMetrics()
    sweeper = Sweeper(
        jobs=SimpleNamespace(shards=[]),  # type: ignore[arg-type]
        pool=pool,  # type: ignore[arg-type]
        settings=GatewaySettings(_env_file=None),  # type: ignore[call-arg]
        metrics=metrics,
    )
    await sweeper.sweep()
    text = generate_latest(metrics.registry).decode()
    for url in urls:
        assert url not in text and url.split(":")[0] not in text
        assert f'gateway_replica_healthy{{replica="{replica_name(url)}"}} 1.0' in text
        assert f'gateway_replica_inflight{{replica="{replica_name(url)}"}} 3.0' in text


# -- webhook refusals -------------------------------------------------------------------


@pytest.mark.parametrize(
    "address", ["10.1.2.3", "127.0.0.1", "169.254.169.254", "fd00::7", "::ffff:10.1.2.3", "64:ff9b::a01:203"]
)
def test_webhook_refusal_of_a_name_never_tells_what_it_resolves_to(address: str) -> None:
    refusal = AddressGuard([]).refusal("hooks.internal.example", ip_address(address), 443)
    assert refusal is not None and "hooks.internal.example" in refusal
    assert address not in refusal and "10.1.2.3" not in refusal
    for kind in ("loopback", "private", "link-local", "mapped", "NAT64"):
        assert kind not in refusal


async def test_webhook_refusal_recorded_for_a_resolved_name_holds_no_address(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    guard = AddressGuard([])

    async def lookup(host: str, port: int) -> list[object]:
        return [ip_address("10.9.8.7")]

    monkeypatch.setattr(guard, "_lookup", lookup)
    with pytest.raises(Refused) as refused:
        await guard.resolve("https://hooks.internal.example/cb")
    assert "10.9.8.7" not in str(refused.value)


def test_webhook_refusal_of_a_literal_address_still_says_why() -> None:
    refusal = AddressGuard([]).refusal("64:ff9b::7f00:1", ip_address("64:ff9b::7f00:1"), 443)
    assert refusal is not None and "NAT64 address of 127.0.0.1" in refusal


# -- AUTH_ENABLED=false -----------------------------------------------------------------


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "gateway.internal"])
def test_auth_disabled_is_refused_unless_the_gateway_binds_to_loopback(host: str) -> None:
    with pytest.raises(ValidationError, match="AUTH_ENABLED=false"):
        GatewaySettings(_env_file=None, auth_enabled=False, host=host)  # type: ignore[call-arg]
    assert GatewaySettings(_env_file=None, host=host).auth_enabled  # type: ignore[call-arg]


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_auth_disabled_is_allowed_on_loopback(host: str) -> None:
    assert not GatewaySettings(_env_file=None, auth_enabled=False, host=host).auth_enabled  # type: ignore[call-arg]


# -- docs pages -------------------------------------------------------------------------


def _paths(**settings: object) -> set[str]:
    edge = create_app(GatewaySettings(_env_file=None, **settings))  # type: ignore[arg-type]
    return {getattr(route, "path", "") for route in edge.app.routes}  # type: ignore[attr-defined]


@pytest.mark.parametrize("public_docs", [True, False])
def test_docs_pages_loading_cdn_scripts_are_off_by_default(public_docs: bool) -> None:
    paths = _paths(public_docs=public_docs)
    assert "/docs" not in paths and "/redoc" not in paths
    assert "/openapi.json" in paths  # the schema stays (behind a key with PUBLIC_DOCS=false)


def test_docs_pages_are_served_with_docs_ui() -> None:
    assert {"/docs", "/redoc", "/openapi.json"} <= _paths(docs_ui=True)
    assert {"/docs", "/openapi.json"} <= _paths(docs_ui=True, public_docs=False)


# -- compose: Redis, MongoDB and the binders' API need their secrets --------------------


def test_compose_redis_and_mongodb_require_passwords_and_the_binders_a_key() -> None:
    services = yaml.safe_load(COMPOSE_FILE.read_text())["services"]
    redis = services["redis"]["command"]
    assert redis[redis.index("--requirepass") + 1].startswith("${REDIS_PASSWORD:?")
    mongo = services["mongo"]
    assert mongo["environment"]["MONGO_INITDB_ROOT_PASSWORD"].startswith("${MONGO_PASSWORD:?")
    assert "--keyFile" in mongo["command"]  # authentication in a replica set
    apps = {name: s for name, s in services.items() if name == "gateway" or name.startswith("binder-")}
    assert len(apps) >= 2
    for name, service in apps.items():
        env = service["environment"]
        assert env["REDIS_URL"].startswith("redis://:${REDIS_PASSWORD:?"), name
        assert "${MONGO_PASSWORD:?" in env["MONGO_URL"] and "authSource=admin" in env["MONGO_URL"], name
        assert env["BINDER_API_KEY"].startswith("${BINDER_API_KEY:?"), name


@pytest.mark.parametrize("manifest", ["binder.yaml", "gateway.yaml"])
def test_kubernetes_binders_and_gateways_get_the_binder_api_key_from_the_secret(manifest: str) -> None:
    base = Path(__file__).resolve().parent.parent / "kubernetes"
    workload = next(yaml.safe_load_all((base / "base" / manifest).read_text()))
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    ref = next(v for v in container["env"] if v["name"] == "BINDER_API_KEY")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "triton-gateway", "key": "BINDER_API_KEY"}  # not optional
    example = yaml.safe_load((base / "examples" / "secret.example.yaml").read_text())
    assert len(example["stringData"]["BINDER_API_KEY"]) >= 16
