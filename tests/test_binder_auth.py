"""The binder's internal API is authenticated: with BINDER_API_KEY every call but /healthz
and /metrics needs `Authorization: Bearer <key>` (the gateway's BinderClient sends it);
without one the binder binds to loopback only (settings refuse another bind address) and
answers loopback peers only."""

from __future__ import annotations

import time

import httpx
import pytest
from pydantic import ValidationError

from binder.app import create_app
from binder.settings import BinderSettings
from gateway.server.errors import Unavailable
from gateway.server.search.binders import BinderClient

KEY = "binder-auth-test-key-0123456789"
AUTH_DB = 58  # a Redis database of its own: this binder must not take the stack binder's results
PROTECTED = [
    ("POST", "/search", {"space": "minilm", "vector": [0.1] * 384}),
    ("POST", "/webhooks/00D209GGVXB1THAC2XKHDBMWGMZ2R726H2C2/replay", {}),
    ("GET", "/dead-letters", None),
    ("POST", "/dead-letters/replay", None),
    ("GET", "/docs", None),  # the API's documents too: they map what the key guards
    ("GET", "/openapi.json", None),
]


@pytest.fixture(autouse=True)
def _no_ambient_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BINDER_API_KEY", raising=False)
    monkeypatch.delenv("BINDER_HOST", raising=False)


def _settings(**values: object) -> BinderSettings:
    return BinderSettings(_env_file=None, **values)  # type: ignore[call-arg]


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "binder.internal"])
def test_binder_refuses_to_bind_beyond_loopback_without_an_api_key(host: str) -> None:
    with pytest.raises(ValidationError, match="BINDER_API_KEY"):
        _settings(binder_host=host)


@pytest.mark.parametrize("host", ["127.0.0.1", "::1", "localhost"])
def test_binder_binds_to_loopback_without_an_api_key(host: str) -> None:
    assert _settings(binder_host=host).binder_api_key is None


def test_binder_binds_beyond_loopback_with_an_api_key() -> None:
    settings = _settings(binder_host="0.0.0.0", binder_api_key=KEY)
    assert settings.binder_api_key is not None and KEY not in repr(settings)


def test_binder_refuses_a_short_api_key() -> None:
    with pytest.raises(ValidationError, match="binder_api_key"):
        _settings(binder_host="0.0.0.0", binder_api_key="short")


async def _call(app: object, peer: str, method: str, path: str, body: object, **headers: str) -> httpx.Response:
    # No lifespan: the guard answers before a handler (and Redis or MongoDB) is reached.
    transport = httpx.ASGITransport(app=app, client=(peer, 40000))  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://binder") as client:
        return await client.request(method, path, json=body, headers=headers)


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
async def test_binder_without_api_key_refuses_non_loopback_peers(method: str, path: str, body: object) -> None:
    app = create_app(_settings(binder_host="127.0.0.1"))
    response = await _call(app, "10.0.0.7", method, path, body)
    assert response.status_code == 403, response.text
    assert "loopback" in response.json()["detail"]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
async def test_binder_with_api_key_refuses_calls_without_the_bearer_key(method: str, path: str, body: object) -> None:
    app = create_app(_settings(binder_host="0.0.0.0", binder_api_key=KEY))
    for peer, headers in [
        ("10.0.0.7", {}),
        ("127.0.0.1", {}),  # loopback is no way around the key once there is one
        ("10.0.0.7", {"Authorization": "Bearer wrong-key-wrong-key-wrong"}),
        ("10.0.0.7", {"Authorization": f"Basic {KEY}"}),
        ("10.0.0.7", {"Authorization": f"Bearer {KEY}x"}),
    ]:
        response = await _call(app, peer, method, path, body, **headers)
        assert response.status_code == 401, (peer, headers, response.text)
        assert response.headers["www-authenticate"] == "Bearer"


@pytest.fixture
def keyed_binder(stack) -> object:
    env = {
        "REDIS_URL": stack.redis_db_url(AUTH_DB),
        "MONGO_DB": f"binder_auth_{time.time_ns()}",
        "BINDER_API_KEY": KEY,
    }
    process, url = stack.start_binder("binder-auth", **env)
    try:
        yield url
    finally:
        stack.stop(process)


async def test_binder_with_api_key_serves_bearer_callers_and_probes_without(keyed_binder: str) -> None:
    async with httpx.AsyncClient(base_url=keyed_binder, timeout=30) as client:
        # Probes and Prometheus need no key (binder_spec's readiness read /healthz too).
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
        assert (await client.get("/dead-letters")).status_code == 401
        keyed = await client.get("/dead-letters", headers={"Authorization": f"Bearer {KEY}"})
        assert keyed.status_code == 200 and keyed.json() == {"dead_letters": []}


async def test_gateway_binder_client_sends_the_binder_api_key(keyed_binder: str) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        keyed = BinderClient([keyed_binder], http, api_key=KEY)
        assert await keyed.nearest("minilm", [0.1] * 384, 5, None) == []
        without = BinderClient([keyed_binder], http)
        with pytest.raises(Unavailable, match="HTTP 401"):
            await without.nearest("minilm", [0.1] * 384, 5, None)


async def test_the_binders_api_documents_are_served_behind_its_key(keyed_binder: str) -> None:
    async with httpx.AsyncClient(base_url=keyed_binder, timeout=30) as client:
        for path in ("/openapi.json", "/docs"):
            assert (await client.get(path)).status_code == 401, path
        keyed = {"Authorization": f"Bearer {KEY}"}
        document = await client.get("/openapi.json", headers=keyed)
        assert document.status_code == 200 and "/search" in document.json()["paths"]
        assert (await client.get("/docs", headers=keyed)).status_code == 200
