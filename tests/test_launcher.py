"""`gateway up`: the whole local stack from one command, and nothing left after Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil

from gateway.stack.process import free_port, port_is_free

GATEWAY = [sys.executable, "-m", "gateway.cli"]


def _up_command(data_dir: Path, ports: dict[str, int]) -> list[str]:
    flags = [f"--{name.replace('_', '-')}={port}" for name, port in ports.items()]
    return [*GATEWAY, "up", f"--data-dir={data_dir}", *flags]


def _ports() -> dict[str, int]:
    names = (
        "triton_http_port",
        "triton_grpc_port",
        "triton_metrics_port",
        "redis_port",
        "mongo_port",
        "gateway_port",
        "binder_port",
    )
    return {name: free_port() for name in names}


def test_up_starts_everything_healthy_and_ctrl_c_leaves_no_process_or_port(tmp_path, tiny_models) -> None:
    ports = _ports()
    env = {**os.environ, "STACK_LLM_MODEL": str(tiny_models["gpt2"]), "STACK_CLIP_MODEL": str(tiny_models["clip"])}
    log = open(tmp_path / "up.log", "w+")  # noqa: SIM115
    up = subprocess.Popen(_up_command(tmp_path / "data", ports), stdout=log, stderr=subprocess.STDOUT, env=env)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 300
        while "all healthy" not in (tmp_path / "up.log").read_text():
            assert up.poll() is None, (tmp_path / "up.log").read_text()
            assert time.monotonic() < deadline, "the stack did not come up in time"
            time.sleep(0.5)
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['gateway_port']}/readyz", timeout=5) as ready:
            assert ready.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{ports['triton_http_port']}/v2/models/llm/ready") as llm:
            assert llm.status == 200
        started = psutil.Process(up.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        for server in ("tritonserver", "redis-server", "nx-27017", "gateway.cli serve", "binder.cli run"):
            assert server in names
    finally:
        up.send_signal(signal.SIGINT)
        code = up.wait(60)
    assert code == 0
    _gone, alive = psutil.wait_procs(started, timeout=10)
    assert not alive, f"still running: {[p.pid for p in alive]}"
    assert all(port_is_free(port) for port in ports.values())
    assert "stopped; no process left behind" in (tmp_path / "up.log").read_text()


def test_up_with_a_taken_port_says_so_in_one_line(tmp_path) -> None:
    ports = _ports()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports["redis_port"]))
        taken.listen()
        result = subprocess.run(_up_command(tmp_path / "data", ports), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    error = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert error == [
        f"error: port {ports['redis_port']} (Redis) is already in use: stop what listens there "
        "or choose another port (see `gateway up --help`)"
    ]
