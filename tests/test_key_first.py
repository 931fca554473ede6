"""The key first: every path but the public ones is authenticated by the edge from the
headers, before a byte of the body is read (gateway.server.api.edge). The first tests run
the edge in process, in front of a small FastAPI app, with a receive() that counts what
was read; the last ones go to the real gateway of the session's stack."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Annotated, Any

import httpx
import pytest
from fastapi import Depends, FastAPI, File, Form, UploadFile
from starlette.types import Message, Scope

from gateway.server.api.edge import Edge
from gateway.server.api.errors import ErrorRenderer, install_error_handlers
from gateway.server.api.hot import HotRoutes
from gateway.server.api.tenancy import Caller, caller
from gateway.server.metrics import GatewayMetrics
from gateway.server.settings import GatewaySettings
from gateway.server.tenants.config import TenantConfig
from tests.conftest import AUTH

GOOD_KEY = "tgw_good_secret"


@dataclass
class Keys:
    verified: list[str] = field(default_factory=list)

    async def verify(self, token: str) -> Any:
        self.verified.append(token)
        if token != GOOD_KEY:
            return None
        return SimpleNamespace(tenant="tenant-a", role="user", key_id="good")


class Tenants:
    async def get(self, tenant: str) -> TenantConfig:
        return TenantConfig(tenant=tenant)


def services(auth_enabled: bool = True) -> Any:
    settings = GatewaySettings(_env_file=None, auth_enabled=auth_enabled)  # type: ignore[call-arg]
    return SimpleNamespace(settings=settings, keys=Keys(), tenants=Tenants())


def edge_app(svc: Any) -> Edge:
    """The edge in front of an app with a JSON route, an upload route and a public one,
    each answering who called."""
    app = FastAPI()
    app.state.services = svc
    errors = ErrorRenderer(renderers={})
    install_error_handlers(app, errors)

    @app.post("/things")
    async def things(body: dict[str, int], who: Annotated[Caller, Depends(caller)]) -> dict[str, Any]:
        return {"tenant": who.tenant, "body": body}

    @app.post("/v1/files")
    async def upload(
        who: Annotated[Caller, Depends(caller)], file: Annotated[UploadFile, File()], purpose: Annotated[str, Form()]
    ) -> dict[str, Any]:
        return {"tenant": who.tenant, "bytes": len(await file.read())}

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    hot = HotRoutes(lambda: svc, errors)
    return Edge(
        app,
        metrics=GatewayMetrics(),
        errors=errors,
        max_bytes=1 << 20,
        body_timeout_s=5,
        uploads={"/v1/files": (300 << 20, 5)},
        hot=hot,
        services=lambda: svc,
    )


@dataclass
class Call:
    """One request through the edge: what it read of the body, and what it answered."""

    reads: int = 0
    messages: list[Message] = field(default_factory=list)

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[bytes, bytes]:
        return dict(self.messages[0]["headers"])

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])


async def call(edge: Edge, method: str, path: str, headers: dict[str, str], chunks: list[bytes]) -> Call:
    """A request whose body comes in `chunks` (the last with more_body false)."""
    done = Call()
    scope: Scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def receive() -> Message:
        done.reads += 1
        if done.reads <= len(chunks):
            return {"type": "http.request", "body": chunks[done.reads - 1], "more_body": done.reads < len(chunks)}
        await asyncio.Event().wait()  # the client sends nothing more
        raise AssertionError("unreachable")

    async def send(message: Message) -> None:
        done.messages.append(message)

    await asyncio.wait_for(edge(scope, receive, send), 10)
    return done


def _upload_chunks(megabytes: int) -> tuple[dict[str, str], list[bytes]]:
    head = b'--x\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
    head += b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    chunks = [head] + [b"a" * (1 << 20)] * megabytes + [b"\r\n--x--\r\n"]
    headers = {"content-type": "multipart/form-data; boundary=x", "content-length": str(sum(map(len, chunks)))}
    return headers, chunks


async def test_an_anonymous_upload_is_refused_before_a_byte_of_its_body_is_read() -> None:
    edge = edge_app(services())
    headers, chunks = _upload_chunks(200)
    for auth in ({}, {"authorization": "Bearer tgw_bad_key"}):
        done = await call(edge, "POST", "/v1/files", {**headers, **auth}, chunks)
        assert done.status == 401, done.body
        assert done.reads == 0  # not one chunk taken: nothing parsed, nothing spooled
        assert done.headers[b"connection"] == b"close"  # and the rest is not read either


async def test_an_upload_with_its_key_is_read_and_stored() -> None:
    edge = edge_app(services())
    headers, chunks = _upload_chunks(2)
    done = await call(edge, "POST", "/v1/files", {**headers, "authorization": f"Bearer {GOOD_KEY}"}, chunks)
    assert done.status == 200, done.body
    assert done.reads == len(chunks)
    assert b'"bytes":2097152' in done.body


@pytest.mark.parametrize("path", ["/things", "/infer"])
async def test_a_malformed_body_without_a_valid_key_is_401_not_422(path: str) -> None:
    edge = edge_app(services())
    for auth, code in (({}, b"missing_api_key"), ({"authorization": "Bearer tgw_bad_key"}, b"invalid_api_key")):
        done = await call(edge, "POST", path, {"content-type": "application/json", **auth}, [b'{"model": '])
        assert done.status == 401, done.body
        assert code in done.body
        assert done.reads == 0


async def test_the_key_is_verified_once_per_request_and_the_route_gets_its_caller() -> None:
    svc = services()
    edge = edge_app(svc)
    auth = {"content-type": "application/json", "authorization": f"Bearer {GOOD_KEY}"}
    done = await call(edge, "POST", "/things", auth, [b'{"a": 1}'])
    assert done.status == 200, done.body
    assert b'"tenant":"tenant-a"' in done.body
    assert svc.keys.verified == [GOOD_KEY]


async def test_a_good_key_with_a_malformed_body_is_still_422() -> None:
    edge = edge_app(services())
    auth = {"content-type": "application/json", "authorization": f"Bearer {GOOD_KEY}"}
    done = await call(edge, "POST", "/things", auth, [b'{"a": '])
    assert done.status == 422, done.body
    assert b"invalid_json" in done.body


async def test_public_paths_need_no_key() -> None:
    svc = services()
    done = await call(edge_app(svc), "GET", "/healthz", {}, [b""])
    assert done.status == 200
    assert svc.keys.verified == []


async def test_with_auth_disabled_every_call_is_the_default_tenant() -> None:
    svc = services(auth_enabled=False)
    done = await call(edge_app(svc), "POST", "/things", {"content-type": "application/json"}, [b'{"a": 1}'])
    assert done.status == 200, done.body
    assert b'"tenant":"default"' in done.body
    assert svc.keys.verified == []


# -- the real gateway -----------------------------------------------------------------------


async def _status_of_declared_upload(port: int, auth: str) -> tuple[bytes, bytes]:
    """POST /v1/files declaring 200 MiB, of which only a few bytes are sent: the status
    line, and what the gateway sent until it closed the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = (
            "POST /v1/files HTTP/1.1\r\nHost: gw\r\n"
            f"{auth}Content-Type: multipart/form-data; boundary=x\r\nContent-Length: {200 * 1024 * 1024}\r\n\r\n"
        )
        writer.write(head.encode() + b"--x\r\nContent-Disposition: form-data; ")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 30)
        rest = await asyncio.wait_for(reader.read(), 30)  # to the end: the gateway closes
        return status_line, rest
    finally:
        writer.close()


async def test_the_gateway_answers_an_anonymous_200_mb_upload_401_without_waiting_for_its_body(stack) -> None:
    # Before: FastAPI read (and spooled) the whole form before the key was looked at, so
    # this connection waited out the upload's body timeout (600 s) instead.
    for auth in ("", "Authorization: Bearer tgw_0000_wrong\r\n"):
        status_line, rest = await _status_of_declared_upload(stack.s.gateway_port, auth)
        assert status_line.split()[1] == b"401", status_line
        assert b"connection: close" in rest.lower()
        assert b"_api_key" in rest


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/infer", "/search", "/admin/keys", "/v1/batches"])
async def test_the_gateway_answers_a_malformed_body_without_a_key_401(stack, path: str) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as anonymous:
        response = await anonymous.post(path, content=b'{"model": ', headers={"content-type": "application/json"})
        assert response.status_code == 401, response.text
        response = await anonymous.post(
            path, content=b"\xff\xfe not even UTF-8", headers={"authorization": "Bearer tgw_0000_wrong"}
        )
        assert response.status_code == 401, response.text


async def test_the_gateway_keeps_its_public_paths_public(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=30) as anonymous:
        for path in ("/healthz", "/readyz", "/ui", "/ui/app.js", "/metrics", "/openapi.json", "/docs"):
            assert (await anonymous.get(path)).status_code == 200, path
        assert (await anonymous.get("/models")).status_code == 401


async def test_the_gateway_still_takes_an_upload_with_its_key(stack) -> None:
    async with httpx.AsyncClient(base_url=stack.gateway_url, timeout=60, headers=AUTH) as client:
        line = b'{"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {}}\n'
        response = await client.post("/v1/files", files={"file": ("a.jsonl", line * 100)}, data={"purpose": "batch"})
        assert response.status_code == 200, response.text
        await client.delete(f"/v1/files/{response.json()['id']}")


async def test_an_upload_past_the_tenants_file_quota_is_refused_before_its_body_is_read(stack) -> None:
    from tests.test_tenants import new_key

    process, url = stack.start_gateway("gateway-upload-quota", TENANT_MAX_FILE_BYTES=str(5 * 1024 * 1024))
    try:
        port = int(url.rsplit(":", 1)[1])
        key = await new_key(stack, "tenant-upload-quota")
        status_line, rest = await _status_of_declared_upload(port, f"Authorization: Bearer {key}\r\n")
        assert status_line.split()[1] == b"403", status_line
        assert b"file_bytes_quota_exceeded" in rest and b"connection: close" in rest.lower()
    finally:
        stack.stop(process)
