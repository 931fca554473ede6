"""A Responses WebSocket (GET /v1/responses upgraded) bounded as an HTTP call is, against
gateways of their own on the real stack: a message over the body limit closes the socket
(1009) while the gateway keeps serving, permessage-deflate is never negotiated, a tenant
holds its share of the process's sockets (429 on the upgrade), an idle socket is closed,
a response.create is refused before it is submitted while the tenant holds its share of
followers, and the upgrade has its request id and access line.

Low limits live in gateways of their own, never in the shared stack's settings."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import websockets.sync.client as ws_client
from websockets.exceptions import ConnectionClosed, ConnectionClosedOK, InvalidStatus

from tests.conftest import AUTH

TERMINAL = ("response.completed", "response.incomplete", "response.failed")
BOUNDS_DB = 51
IDLE_DB = 52
IDLE_S = 2.0


@pytest.fixture(scope="module")
def bounds(stack) -> Iterator[dict[str, Any]]:
    """A gateway with room for 8 sockets, 2 a tenant, and 4 followers, 1 a tenant; JSON logs."""
    process, url = stack.start_gateway(
        "gateway-ws-bounds",
        REDIS_URL=stack.redis_db_url(BOUNDS_DB),
        RESPONSES_WS_MAX="8",
        RESPONSES_WS_TENANT_SHARE="0.25",
        RESPONSES_WS_TENANT_FLOOR="1",
        MAX_FOLLOWERS="4",
        TENANT_FOLLOWER_SHARE="0.25",
        TENANT_FOLLOWER_FLOOR="1",
        LOG_FORMAT="json",
        DRAIN_S="0",
    )
    yield {"url": url, "pid": process.pid, "log": stack.data_dir / "logs" / "gateway-ws-bounds.log"}
    stack.stop(process)


@pytest.fixture(scope="module")
def idle(stack) -> Iterator[dict[str, Any]]:
    """A gateway that closes a socket idle for IDLE_S."""
    process, url = stack.start_gateway(
        "gateway-ws-idle", REDIS_URL=stack.redis_db_url(IDLE_DB), RESPONSES_WS_IDLE_S=str(IDLE_S), DRAIN_S="0"
    )
    yield {"url": url, "pid": process.pid}
    stack.stop(process)


def _key(stack, name: str) -> str:
    """The key of a new tenant."""
    response = httpx.post(
        f"{stack.gateway_url}/admin/keys",
        json={"tenant": f"{name}-{time.time_ns()}", "name": "ws bounds test"},
        headers=dict(AUTH),
        timeout=30,
    )
    assert response.status_code == 201, response.text
    return response.json()["key"]


def _connect(url: str, key: str, **kwargs: Any) -> ws_client.ClientConnection:
    return ws_client.connect(
        url.replace("http://", "ws://") + "/v1/responses",
        additional_headers={"Authorization": f"Bearer {key}", **kwargs.pop("headers", {})},
        open_timeout=60,
        **kwargs,
    )


def _rss_kb(pid: int) -> int:
    found = re.search(r"^VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert found is not None
    return int(found.group(1))


class _Probe:
    """GET /healthz every 50 ms from a thread; the longest wait meanwhile."""

    def __init__(self, url: str) -> None:
        self.url, self.longest, self.answered = url, 0.0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                assert client.get(f"{self.url}/healthz").status_code == 200
                self.longest = max(self.longest, time.perf_counter() - started)
                self.answered += 1
                self._stop.wait(0.05)

    def __enter__(self) -> _Probe:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _events_until(socket: ws_client.ClientConnection, done: Any) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    while not events or not done(events[-1]):
        events.append(json.loads(socket.recv(timeout=120)))
    return events


# -- messages --------------------------------------------------------------------------------


def test_a_message_over_the_body_limit_closes_the_socket_1009_while_the_gateway_serves(stack, idle) -> None:
    # A text frame of 16 MiB (uvicorn's default cap, which the base code took whole): twice
    # the gateway's 8 MiB limit. Its header and its first MiB are sent, then the client
    # waits: the refusal must come from the header, before the rest is read (sent whole, the
    # server's close would race the client's still-arriving bytes and end in a reset).
    size, mask = 16 * 1024 * 1024, b"\x01\x02\x03\x04"
    head = bytes([0x81, 0x80 | 127]) + size.to_bytes(8, "big") + mask
    part = bytes(b ^ mask[i % 4] for i, b in enumerate(b"x" * 4096)) * 256  # 1 MiB, masked
    before = _rss_kb(idle["pid"])
    with _Probe(idle["url"]) as probe, _connect(idle["url"], stack.api_key, compression=None) as socket:
        socket.socket.sendall(head + part)
        with pytest.raises(ConnectionClosed):
            socket.recv(timeout=60)  # the base code waited for the other 15 MiB here
        seen = probe.answered  # served meanwhile, and after
        deadline = time.monotonic() + 60
        while probe.answered <= seen:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert socket.close_code == 1009, (socket.close_code, socket.close_reason)
    grown = _rss_kb(idle["pid"]) - before
    print(f"longest /healthz wait {probe.longest * 1000:.0f} ms, RSS {grown / 1024:+.1f} MB")  # (pytest -s)
    assert probe.longest < 1.0, probe.longest
    assert grown < 100 * 1024


def test_a_message_of_too_many_json_values_is_refused_unparsed_and_the_socket_stays(stack, idle) -> None:
    # Under the 8 MiB cap, 2.8 million empty arrays: json.loads on the loop ~1 s here.
    message = '{"type": "response.create", "model": "llm_echo", "input": [' + ",".join(["[]"] * 2_700_000) + "]}"
    before = _rss_kb(idle["pid"])
    with _Probe(idle["url"]) as probe, _connect(idle["url"], stack.api_key, compression=None) as socket:
        socket.send(message)
        refusal = json.loads(socket.recv(timeout=120))
        assert refusal["type"] == "error" and refusal["status"] == 413, refusal  # base: parsed, then 400
        assert refusal["error"]["code"] == "too_many_json_values"
        socket.send(json.dumps({"type": "response.cancel"}))  # the socket serves on
        assert json.loads(socket.recv(timeout=60))["error"]["code"] == "unsupported_event"
    grown = _rss_kb(idle["pid"]) - before
    print(f"longest /healthz wait {probe.longest * 1000:.0f} ms, RSS {grown / 1024:+.1f} MB")  # (pytest -s)
    assert probe.longest < 1.0, probe.longest
    assert grown < 100 * 1024


def test_permessage_deflate_is_not_negotiated(stack, idle) -> None:
    with _connect(idle["url"], stack.api_key, compression="deflate") as socket:  # the client offers it
        assert socket.request is not None and "permessage-deflate" in socket.request.headers["Sec-WebSocket-Extensions"]
        assert socket.response is not None
        assert "Sec-WebSocket-Extensions" not in socket.response.headers
        socket.send(json.dumps({"type": "response.cancel"}))
        assert json.loads(socket.recv(timeout=60))["error"]["code"] == "unsupported_event"


def test_a_compressed_frame_sent_without_negotiation_closes_the_socket_1002(stack, idle) -> None:
    with _connect(idle["url"], stack.api_key, compression=None) as socket:
        payload, mask = b"\xf2\x48\xcd\xc9\xc9\x07\x00", b"\x01\x02\x03\x04"  # "Hello", deflated
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        socket.socket.sendall(bytes([0xC1, 0x80 | len(payload)]) + mask + masked)  # FIN, RSV1, text
        with pytest.raises(ConnectionClosed):
            socket.recv(timeout=60)
    assert socket.close_code == 1002


# -- the idle timeout ------------------------------------------------------------------------


def test_an_idle_socket_is_closed_with_an_error_event(stack, idle) -> None:
    with _connect(idle["url"], stack.api_key) as socket:
        notice = json.loads(socket.recv(timeout=120))  # the base code kept it open for 60 minutes
        assert notice["type"] == "error" and notice["error"]["code"] == "websocket_idle_timeout"
        with pytest.raises(ConnectionClosedOK):
            socket.recv(timeout=60)
    assert socket.close_code == 1000


def test_a_response_in_flight_outlasts_the_idle_timeout_and_the_clock_runs_from_its_end(stack, idle) -> None:
    # llm_synthetic makes a token every 20 ms: 300 tokens take 6 s, three times IDLE_S.
    create = {"type": "response.create", "model": "llm_synthetic", "input": "Go on.", "max_output_tokens": 300}
    with _connect(idle["url"], stack.api_key) as socket:
        socket.send(json.dumps(create))
        events = _events_until(socket, lambda e: e["type"] in TERMINAL or e["type"] == "error")
        assert events[-1]["type"] in ("response.completed", "response.incomplete"), events[-1]
        ended = time.monotonic()
        notice = json.loads(socket.recv(timeout=120))
        assert notice["error"]["code"] == "websocket_idle_timeout"
        assert time.monotonic() - ended >= IDLE_S * 0.9  # from the response's end, not the message's
    assert socket.close_code == 1000


# -- shares ----------------------------------------------------------------------------------


def test_a_tenant_holding_its_share_of_sockets_gets_429_on_the_upgrade_and_another_tenant_does_not(
    stack, bounds
) -> None:
    a, b = _key(stack, "ws-share-a"), _key(stack, "ws-share-b")
    first, second = _connect(bounds["url"], a), _connect(bounds["url"], a)
    try:
        with pytest.raises(InvalidStatus) as refused:
            _connect(bounds["url"], a)
        answer = refused.value.response
        assert answer.status_code == 429  # the base code accepted every socket
        body = json.loads(answer.body)
        assert body["error"]["code"] == "tenant_share_exceeded", body
        assert answer.headers["Retry-After"] == "1"
        with _connect(bounds["url"], b) as other:  # another tenant: as ever
            other.send(json.dumps({"type": "response.cancel"}))
            assert json.loads(other.recv(timeout=60))["error"]["code"] == "unsupported_event"
    finally:
        first.close()
    # A socket closed gives its place back (once the gateway has seen the close).
    deadline = time.monotonic() + 60
    while True:
        try:
            _connect(bounds["url"], a).close()
            break
        except InvalidStatus as still:
            assert still.response.status_code == 429 and time.monotonic() < deadline
            time.sleep(0.1)
    second.close()


def _accepted(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r"^gateway_requests_accepted_total\{[^}]*\} (\S+)$", metrics, re.M))


def test_a_response_create_past_the_follower_share_is_refused_before_it_is_submitted(stack, bounds) -> None:
    key = _key(stack, "ws-followers")
    long = {"type": "response.create", "model": "llm_synthetic", "input": "Go on.", "max_output_tokens": 1000}
    with _connect(bounds["url"], key) as holder, _connect(bounds["url"], key) as second:
        holder.send(json.dumps(long))  # follows its response: the tenant's one follower
        _events_until(holder, lambda e: e["type"] == "response.output_text.delta")
        before = _accepted(bounds["url"])
        second.send(json.dumps({**long, "max_output_tokens": 20}))
        refusal = json.loads(second.recv(timeout=60))
        assert refusal["type"] == "error" and refusal["status"] == 429, refusal
        assert refusal["error"]["code"] == "tenant_share_exceeded"
        # Nothing was submitted (the base code submitted it, then could not follow it).
        assert _accepted(bounds["url"]) == before


# -- the edge's part -------------------------------------------------------------------------


def _logged(path: Path, wanted: Any, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    parsed = json.loads(line)
                except ValueError:
                    continue
                if wanted(parsed):
                    return parsed
        assert time.monotonic() < deadline, f"no such line in {path.name}"
        time.sleep(0.1)


def test_an_upgrade_has_its_request_id_and_an_access_line(stack, bounds) -> None:
    trace = f"ws-{time.time_ns()}"
    with _connect(bounds["url"], stack.api_key, headers={"X-Request-ID": trace}) as socket:
        assert socket.response is not None and socket.response.headers["X-Request-ID"] == trace
    refused_trace = f"ws-refused-{time.time_ns()}"
    with pytest.raises(InvalidStatus) as refused:
        _connect(bounds["url"], "sk-not-a-key", headers={"X-Request-ID": refused_trace})
    assert refused.value.response.headers["X-Request-ID"] == refused_trace

    def access(trace_id: str, status: int) -> Any:
        return lambda line: (
            line.get("logger") == "gateway.access"
            and line.get("trace_id") == trace_id
            and f"WEBSOCKET /v1/responses {status} " in json.dumps(line)
        )

    _logged(bounds["log"], access(trace, 101))
    _logged(bounds["log"], access(refused_trace, 401))
