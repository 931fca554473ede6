"""nginx/nginx.conf with Debian's nginx: `nginx -t`, and a real run in front of a stand-in
gateway (SSE passes unbuffered, limits and errors answer in JSON)."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from gateway.deploy import ToolError
from gateway.deploy.nginx import NGINX_CONF, ensure_nginx, localize, nginx_test, write_local_conf
from gateway.server.settings import GatewaySettings


@pytest.fixture(scope="session")
def nginx_bin() -> Path:
    try:
        return ensure_nginx()
    except ToolError as exc:
        pytest.fail(f"{exc} (see tools/get_nginx.sh)")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_nginx_t_passes_on_the_production_config(nginx_bin: Path, tmp_path: Path) -> None:
    conf = write_local_conf(
        tmp_path,
        http_port=_free_port(),
        gateways=["127.0.0.1:18080", "127.0.0.1:18081"],
        grpc_port=_free_port(),
        tritons=["127.0.0.1:18001", "127.0.0.1:18002"],
    )
    result = nginx_test(nginx_bin, conf, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "test is successful" in result.stderr


def test_nginx_t_passes_without_the_optional_grpc_upstream(nginx_bin: Path, tmp_path: Path) -> None:
    conf = write_local_conf(tmp_path, http_port=_free_port(), gateways=["127.0.0.1:18080"])
    assert "grpc_pass" not in conf.read_text()
    result = nginx_test(nginx_bin, conf, tmp_path)
    assert result.returncode == 0, result.stderr


def test_production_config_balances_least_conn_and_keeps_streams_unbuffered() -> None:
    text = NGINX_CONF.read_text()
    gateways = text[text.index("upstream gateways {") :].split("}", 1)[0]
    assert "least_conn;" in gateways
    assert "server gateway:8080" in gateways
    for directive in (
        "proxy_buffering off;",
        "proxy_read_timeout 3600s;",
        "client_max_body_size 8m;",
        "location = /health",
        "grpc_pass grpc://tritons;",
    ):
        assert directive in text


def test_only_file_uploads_take_bodies_up_to_the_gateways_file_limit() -> None:
    text = NGINX_CONF.read_text()
    sizes = re.findall(r"client_max_body_size (\d+)m;", text.split("# BEGIN optional triton-grpc")[0])
    assert sizes == ["8", "201"]  # the http block's, then the one location's
    location = text[text.index("location = /v1/files {") :].split("}", 1)[0]
    files_limit = GatewaySettings.model_fields["max_file_bytes"].default + (1 << 20)  # the edge's, with the form
    assert f"client_max_body_size {files_limit >> 20}m;" in location
    assert GatewaySettings.model_fields["max_body_bytes"].default == 8 << 20
    assert "proxy_pass http://gateways;" in location


def test_localize_fails_loudly_when_nginx_conf_no_longer_matches(tmp_path: Path) -> None:
    changed = NGINX_CONF.read_text().replace("listen 80;", "listen 8080;")
    with pytest.raises(ToolError, match="listen 80"):
        localize(changed, workdir=tmp_path, http_port=1, gateways=["127.0.0.1:2"])


# ---- a real nginx in front of a stand-in gateway ---------------------------------------


class _Gateway(BaseHTTPRequestHandler):
    """Answers /events with two SSE events, the second only once the test has the first."""

    release = threading.Event()

    def do_GET(self) -> None:
        if self.path != "/events":
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "11")
            self.end_headers()
            self.wfile.write(b'{"ok":true}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        self.wfile.write(b"id: 1\ndata: first\n\n")
        self.wfile.flush()
        self.release.wait(timeout=10)
        self.wfile.write(b"id: 2\ndata: second\n\n")
        self.wfile.flush()
        self.close_connection = True

    def do_POST(self) -> None:
        """Reads the body and answers with its length."""
        remaining = int(self.headers["Content-Length"])
        while remaining:
            remaining -= len(self.rfile.read(min(remaining, 1 << 20)))
        body = b'{"received":%d}' % int(self.headers["Content-Length"])
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _running_nginx(binary: Path, workdir: Path, gateways: list[str]) -> Iterator[str]:
    port = _free_port()
    conf = write_local_conf(workdir, http_port=port, gateways=gateways)
    proc = subprocess.Popen(
        [str(binary), "-p", str(workdir), "-c", str(conf), "-e", str(workdir / "startup.log"), "-g", "daemon off;"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"nginx did not start: {proc.stderr.read() if proc.stderr else ''}")
            time.sleep(0.05)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture()
def gateway_stub() -> Iterator[str]:
    _Gateway.release.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    _Gateway.release.set()
    server.shutdown()
    server.server_close()


def test_nginx_health_answers_itself(nginx_bin: Path, tmp_path: Path) -> None:
    with _running_nginx(nginx_bin, tmp_path, [f"127.0.0.1:{_free_port()}"]) as base:
        response = httpx.get(f"{base}/health")
        assert response.status_code == 200
        assert response.text == "ok\n"


def test_sse_events_pass_through_nginx_as_they_are_sent(nginx_bin: Path, tmp_path: Path, gateway_stub: str) -> None:
    with _running_nginx(nginx_bin, tmp_path, [gateway_stub]) as base:
        with httpx.stream("GET", f"{base}/events", timeout=5) as response:
            assert response.headers["content-type"] == "text/event-stream"
            lines = response.iter_lines()
            # The stand-in sends the second event only after we have the first: a buffering
            # proxy would hold the first back and this would time out.
            assert next(lines) == "id: 1"
            assert next(lines) == "data: first"
            _Gateway.release.set()
            rest = list(lines)
        assert "data: second" in rest


def test_oversized_body_is_refused_with_json_413(nginx_bin: Path, tmp_path: Path, gateway_stub: str) -> None:
    with _running_nginx(nginx_bin, tmp_path, [gateway_stub]) as base:
        response = httpx.post(f"{base}/infer", content=b"x" * (8 * 1024 * 1024 + 1), timeout=10)
        assert response.status_code == 413
        assert response.json()["error"]["code"] == "payload_too_large"


def test_a_file_upload_over_8_mib_passes_and_one_over_the_file_limit_is_refused(
    nginx_bin: Path, tmp_path: Path, gateway_stub: str
) -> None:
    with _running_nginx(nginx_bin, tmp_path, [gateway_stub]) as base:
        size = 9 * 1024 * 1024 + 1
        response = httpx.post(f"{base}/v1/files", content=b"x" * size, timeout=60)
        assert response.status_code == 200, response.text
        assert response.json() == {"received": size}
        # Over the file limit: refused on the declared length, before the body is sent.
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Length: {202 << 20}\r\n\r\n".encode())
            head = sock.makefile("rb").read(4096).decode(errors="replace")
        assert head.split()[1] == "413", head
        assert '"file_too_large"' in head


def test_unreachable_gateways_give_json_503_with_retry_after(nginx_bin: Path, tmp_path: Path) -> None:
    with _running_nginx(nginx_bin, tmp_path, [f"127.0.0.1:{_free_port()}"]) as base:
        response = httpx.get(f"{base}/results/abc", timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "unavailable"
        assert response.headers["retry-after"] == "1"
