"""X-Request-ID from nginx or the client through the gateway, its dispatcher and the
binder's archiver and webhook sender (each logs under it as `trace_id`), to webhook
receivers; and the observability metrics: HTTP per route, binder lag and webhooks.

The log tests run on a gateway and a binder of their own (a Redis database of their own,
JSON logs, the binder at DEBUG for its per-result lines), so the lines they look for
can only come from those two processes."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
import redis.asyncio as aioredis
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from binder.metrics import results_backlog
from gateway.deploy.nginx import ensure_nginx, write_local_conf
from gateway.protocol import ResultRecord
from gateway.protocol.redis_keys import BINDER_GROUP, Shard
from gateway.stack.process import free_port
from tests.conftest import AUTH
from tests.gateway_calls import wait_result
from tests.records import publish, text_record

RESULTS_STREAM = Shard(0).results

TRACE = "abc-123"
NEW_ID = re.compile(r"[0-9a-f]{32}")  # nginx's $request_id and the gateway's own: the same shape
TRACED_DB = 62
LAG_DB = 63


# ---- helpers ---------------------------------------------------------------------------


def _log_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a service's log file (uvicorn's own plain lines are skipped)."""
    lines = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


async def _logged(path: Path, wanted: Callable[[dict[str, Any]], bool], timeout: float = 20) -> list[dict[str, Any]]:
    """The lines that match, once there is one (logs reach the file as they are written)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [line for line in _log_lines(path) if wanted(line)]
        if found:
            return found
        assert time.monotonic() < deadline, f"no such line in {path.name} after {timeout}s"
        await asyncio.sleep(0.1)


def _about(trace_id: str, request_id: str, logger: str) -> Callable[[dict[str, Any]], bool]:
    def wanted(line: dict[str, Any]) -> bool:
        return (
            line.get("logger", "").startswith(logger)
            and line.get("trace_id") == trace_id
            and line.get("request_id") == request_id
        )

    return wanted


def _sample(metrics: str, name: str, **labels: str) -> float | None:
    """The value of one sample; None when there is no such series."""
    for family in text_string_to_metric_families(metrics):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def _count(metrics: str, name: str, **labels: str) -> float:
    """A counter's value, 0 before its first increment."""
    return _sample(metrics, name, **labels) or 0.0


@dataclass
class Receiver:
    """Records each webhook POST (path, headers) and answers 200."""

    port: int = 0
    calls: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        self.calls.append((scope["path"], {k.decode(): v.decode() for k, v in scope["headers"]}))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


# ---- fixtures --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced(stack) -> Iterator[dict[str, Any]]:
    """A gateway and a binder on a Redis database of their own, logging JSON."""
    env = {"REDIS_URL": stack.redis_db_url(TRACED_DB), "LOG_FORMAT": "json"}
    # DEBUG: the run's own lines (the spine's deliver stage) are below INFO, where the
    # access line is a request's only one.
    gateway, gateway_url = stack.start_gateway("gateway-traced", LOG_LEVEL="DEBUG", **env)
    binder, binder_url = stack.start_binder("binder-traced", LOG_LEVEL="DEBUG", **env)
    logs = stack.data_dir / "logs"
    yield {
        "gateway": gateway_url,
        "binder": binder_url,
        "gateway_log": logs / "gateway-traced.log",
        "binder_log": logs / "binder-traced.log",
    }
    stack.stop(binder)
    stack.stop(gateway)


@pytest_asyncio.fixture(scope="module")
async def receiver() -> AsyncIterator[Receiver]:
    app = Receiver(port=free_port())
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=app.port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    yield app
    server.should_exit = True
    await task


@pytest_asyncio.fixture(scope="module")
async def traced_request(traced, receiver) -> dict[str, Any]:
    """One request sent with X-Request-ID: abc-123 and a webhook, run to the end and its
    webhook delivered."""
    path = f"/hook-{uuid.uuid4().hex}"
    body = {
        "model": "clip_text",
        "inputs": {"text": "trace me"},
        "webhook": {"url": f"http://127.0.0.1:{receiver.port}{path}"},
    }
    async with httpx.AsyncClient(base_url=traced["gateway"], headers=AUTH, timeout=60) as client:
        response = await client.post("/infer", json=body, headers={"X-Request-ID": TRACE})
        assert response.status_code == 202, response.text
        request_id = response.json()["request_id"]
        record = await wait_result(client, request_id)
        deadline = time.monotonic() + 20
        while not any(p == path for p, _ in receiver.calls):
            assert time.monotonic() < deadline, "the webhook did not arrive"
            await asyncio.sleep(0.05)
    return {
        "request_id": request_id,
        "response": response,
        "record": record,
        "webhook_headers": next(h for p, h in receiver.calls if p == path),
    }


@pytest.fixture(scope="module")
def nginx_in_front(traced, tmp_path_factory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("nginx-trace")
    port = free_port()
    conf = write_local_conf(workdir, http_port=port, gateways=[traced["gateway"].removeprefix("http://")])
    argv = [str(ensure_nginx()), "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "error.log")]
    nginx = subprocess.Popen([*argv, "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 15
    while True:
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert nginx.poll() is None and time.monotonic() < deadline, (workdir / "error.log").read_text()
        time.sleep(0.1)
    yield {"url": base, "access_log": workdir / "access.log"}
    nginx.terminate()  # by its pid
    nginx.wait(10)


# ---- the id, end to end ----------------------------------------------------------------


async def test_the_x_request_id_comes_back_in_the_response_header(traced_request) -> None:
    assert traced_request["response"].headers.get_list("x-request-id") == [TRACE]


async def test_the_gateway_logs_the_submit_under_the_x_request_id_and_the_request_id(traced, traced_request) -> None:
    lines = await _logged(traced["gateway_log"], _about(TRACE, traced_request["request_id"], "gateway.access"))
    assert any(line["event"].startswith("POST /infer 202") for line in lines), lines


async def test_the_run_is_logged_under_the_x_request_id(traced, traced_request) -> None:
    wanted = _about(TRACE, traced_request["request_id"], "gateway.server.spine")  # (its deliver stage)
    lines = await _logged(traced["gateway_log"], wanted)
    assert any("succeeded" in line["event"] for line in lines), lines


async def test_the_binder_logs_storing_the_result_under_the_x_request_id(traced, traced_request) -> None:
    lines = await _logged(traced["binder_log"], _about(TRACE, traced_request["request_id"], "binder.archive"))
    assert any(line["event"].startswith("stored") for line in lines), lines


async def test_the_webhook_sender_logs_its_attempts_under_the_x_request_id(traced, traced_request) -> None:
    wanted = _about(TRACE, traced_request["request_id"], "binder.webhooks.sender")
    lines = await _logged(traced["binder_log"], wanted)
    assert any("delivered" in line["event"] for line in lines), lines


async def test_webhook_receivers_get_the_x_request_id_header(traced_request) -> None:
    assert traced_request["webhook_headers"]["x-request-id"] == TRACE


async def test_the_result_record_keeps_the_x_request_id(traced_request) -> None:
    assert traced_request["record"]["trace_id"] == TRACE


def test_a_record_stored_before_trace_ids_still_reads() -> None:
    old = text_record().model_dump(mode="json")
    old.pop("trace_id", None)
    assert ResultRecord.model_validate(old).trace_id is None


@pytest.mark.parametrize("sent", ["abc-123", str(uuid.uuid4()), "01JD3E4F5G6H7J8K9M0N1P2Q3R", "req.7:a/b+c=d@e~f_g"])
async def test_a_sane_x_request_id_is_kept_as_sent(http, sent: str) -> None:
    response = await http.get("/healthz", headers={"X-Request-ID": sent})
    assert response.headers.get_list("x-request-id") == [sent]


@pytest.mark.parametrize(
    "sent",
    [None, b"two words", b"x" * 129, b'quote"d', "caf\u00e9".encode("latin-1"), b"a;b"],
    ids=["none", "space", "too-long", "quote", "not-ascii", "semicolon"],
)
async def test_a_missing_or_unusable_x_request_id_is_replaced_by_a_new_one(http, sent: bytes | None) -> None:
    headers = {"X-Request-ID": sent} if sent is not None else {}
    response = await http.get("/healthz", headers=headers)
    [given] = response.headers.get_list("x-request-id")
    assert NEW_ID.fullmatch(given), given


# ---- through nginx ---------------------------------------------------------------------


async def test_nginx_gives_its_own_id_when_the_client_sent_none(traced, nginx_in_front) -> None:
    async with httpx.AsyncClient(base_url=nginx_in_front["url"], headers=AUTH, timeout=30) as client:
        response = await client.post("/infer", json={"model": "clip_text", "inputs": {"text": "via nginx"}})
    assert response.status_code == 202, response.text
    [given] = response.headers.get_list("x-request-id")
    assert NEW_ID.fullmatch(given), given
    request_id = response.json()["request_id"]
    await _logged(traced["gateway_log"], _about(given, request_id, "gateway.access"))
    deadline = time.monotonic() + 10
    while f"trace_id={given}" not in nginx_in_front["access_log"].read_text():
        assert time.monotonic() < deadline, "nginx's access log has no line with the id"
        await asyncio.sleep(0.1)


@pytest.mark.parametrize(("sent", "kept"), [("client-7", True), ("x" * 200, False)], ids=["sane", "too-long"])
async def test_nginx_passes_a_sane_client_id_on_and_replaces_an_unusable_one(
    traced, nginx_in_front, sent: str, kept: bool
) -> None:
    async with httpx.AsyncClient(base_url=nginx_in_front["url"], headers=AUTH, timeout=30) as client:
        response = await client.get(f"/results/{uuid.uuid4().hex}", headers={"X-Request-ID": sent})
    [given] = response.headers.get_list("x-request-id")  # once: nginx's, not also the gateway's
    assert (given == sent) if kept else NEW_ID.fullmatch(given), given
    # The gateway logged the call under the same id nginx returned.
    await _logged(
        traced["gateway_log"], lambda line: line.get("trace_id") == given and "GET /results/" in line["event"]
    )


async def test_nginx_passes_the_durable_request_id_of_a_v1_answer_on_unchanged(traced, nginx_in_front) -> None:
    async with httpx.AsyncClient(base_url=nginx_in_front["url"], headers=AUTH, timeout=60) as client:
        response = await client.post(
            "/v1/embeddings", json={"model": "text_embed", "input": "via nginx"}, headers={"X-Request-ID": "client-v1"}
        )
        assert response.status_code == 200, response.text
        # The gateway's X-Request-ID names the durable request (as OpenAI's does); the
        # call's own id is in X-Trace-ID. nginx must not put its trace id in its place.
        [request_id] = response.headers.get_list("x-request-id")
        assert response.headers.get_list("x-trace-id") == ["client-v1"]
        assert request_id != "client-v1"
        stored = await client.get(f"/results/{request_id}")
    assert stored.status_code == 200, stored.text
    assert stored.json()["request_id"] == request_id


# ---- HTTP metrics per route ------------------------------------------------------------


async def _metrics(client: httpx.AsyncClient) -> str:
    response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text


async def test_http_requests_are_counted_by_route_template_not_by_path(http) -> None:
    labels = {"route": "/results/{request_id}", "method": "GET", "status": "404"}
    before = _count(await _metrics(http), "gateway_http_requests_total", **labels)
    unknown = [uuid.uuid4().hex for _ in range(2)]
    for request_id in unknown:
        assert (await http.get(f"/results/{request_id}")).status_code == 404
    after = await _metrics(http)
    assert _count(after, "gateway_http_requests_total", **labels) == before + 2
    assert not any(request_id in after for request_id in unknown)


async def test_a_path_that_matches_no_route_is_counted_as_unmatched(http) -> None:
    labels = {"route": "unmatched", "method": "GET", "status": "404"}
    before = _count(await _metrics(http), "gateway_http_requests_total", **labels)
    path = f"/no-such-{uuid.uuid4().hex}"
    assert (await http.get(path)).status_code == 404
    after = await _metrics(http)
    assert _count(after, "gateway_http_requests_total", **labels) == before + 1
    assert path not in after


async def test_an_unknown_method_is_counted_as_other(http) -> None:
    labels = {"route": "/healthz", "method": "other"}
    before = _count(await _metrics(http), "gateway_http_requests_total", **labels)
    await http.request("PROPFIND", "/healthz")  # a method the HTTP parser knows, the API does not
    assert _count(await _metrics(http), "gateway_http_requests_total", **labels) == before + 1


async def test_a_body_refused_before_routing_is_counted_under_its_route(http, stack) -> None:
    labels = {"route": "/infer", "method": "POST", "status": "413"}
    before = _count(await _metrics(http), "gateway_http_requests_total", **labels)
    # Declared too large (and never sent): refused on the header, before any route ran.
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.s.gateway_port)
    auth = "".join(f"{k}: {v}\r\n" for k, v in AUTH.items())
    writer.write(f"POST /infer HTTP/1.1\r\nHost: gw\r\n{auth}Content-Length: {9 * 1024 * 1024}\r\n\r\n".encode())
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status_line.split()[1] == b"413", status_line
    assert _count(await _metrics(http), "gateway_http_requests_total", **labels) == before + 1


async def test_http_latency_is_observed_per_route(http) -> None:
    labels = {"route": "/models", "method": "GET"}
    before = _count(await _metrics(http), "gateway_http_request_duration_seconds_count", **labels)
    assert (await http.get("/models")).status_code == 200
    after = await _metrics(http)
    assert _count(after, "gateway_http_request_duration_seconds_count", **labels) == before + 1
    assert _count(after, "gateway_http_request_duration_seconds_sum", **labels) > 0


# ---- binder metrics --------------------------------------------------------------------


@pytest_asyncio.fixture
async def lag_redis(stack) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.from_url(stack.redis_db_url(LAG_DB), decode_responses=True)
    await client.flushdb()
    yield client
    await client.flushdb()
    await client.aclose()


async def test_results_lag_counts_unread_entries_and_pending_counts_unstored_ones(lag_redis) -> None:
    await lag_redis.xgroup_create(RESULTS_STREAM, BINDER_GROUP, id="0", mkstream=True)
    await publish(lag_redis, [text_record(f"r{i}") for i in range(5)])
    await lag_redis.xreadgroup(BINDER_GROUP, "binder-x", {RESULTS_STREAM: ">"}, count=2)  # read, not acknowledged
    assert await results_backlog(lag_redis, RESULTS_STREAM) == (3, 2)


async def test_results_lag_is_the_whole_stream_before_any_binder_joined(lag_redis) -> None:
    await publish(lag_redis, [text_record(f"r{i}") for i in range(4)])
    assert await results_backlog(lag_redis, RESULTS_STREAM) == (4, 0)


async def test_results_lag_is_zero_before_anything_was_published(lag_redis) -> None:
    assert await results_backlog(lag_redis, RESULTS_STREAM) == (0, 0)


async def test_the_binder_exports_lag_webhook_outcomes_and_results_stored(traced, traced_request) -> None:
    async with httpx.AsyncClient(base_url=traced["binder"], timeout=30) as client:
        text = (await client.get("/metrics")).text
        assert _count(text, "binder_webhook_attempts_total", outcome="delivered") >= 1
        assert _count(text, "binder_results_stored_total") >= 1
        # Once the binder has stored all this Redis database's results, both are 0.
        deadline = time.monotonic() + 20
        while (_sample(text, "binder_results_lag"), _sample(text, "binder_results_pending")) != (0, 0):
            assert time.monotonic() < deadline, text
            await asyncio.sleep(0.2)
            text = (await client.get("/metrics")).text
