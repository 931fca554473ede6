"""`gateway up`: the whole local stack from one command, supervised, private on disk, and
nothing left after Ctrl-C. The helpers here start the real console script the way
`make up` does (its own process group) and are shared with test_stopping.py."""

from __future__ import annotations

import glob
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest
import redis

from gateway.stack.owners import TAG_ENV, TRITON_SHM_PREFIX, owned_processes
from gateway.stack.process import free_port, port_is_free
from gateway.stack.services import binder_spec, gateway_spec
from gateway.stack.settings import GIB, PORTS, StackSettings, redis_maxmemory
from gateway.stack.stack import LocalStack

# The console script, as the Makefile's `up` target runs it.
GATEWAY = [str(Path(sys.executable).parent / "gateway")]
STOP_BUDGET_S = 10.0
START_TIMEOUT_S = 300.0
# `make up` started in the background by a script: a non-interactive shell starts `&` jobs
# with SIGINT ignored, and the launcher inherits that. The sh in between records the
# dispositions it hands to the launcher it then becomes (exec). $0 is the output file.
_BACKGROUND_SCRIPT = (
    """sh -c 'grep "^SigIgn:" /proc/self/status > "$0.sigign"; exec "$@"' "$0" "$@" > "$0" 2>&1 & """
    """echo $! > "$0.pid"; wait"""
)


def _up_command(data_dir: Path, ports: dict[str, int]) -> list[str]:
    flags = [f"--{name.replace('_', '-')}={port}" for name, port in ports.items()]
    return [*GATEWAY, "up", f"--data-dir={data_dir}", *flags]


def _ports() -> dict[str, int]:
    return {name: free_port() for name in PORTS}


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class UpRun:
    """One `gateway up` in a process group of its own, its output in a file."""

    pid: int
    popen: subprocess.Popen[bytes] | None  # None when a script started it (not our child)
    output_file: Path
    ports: dict[str, int]
    data_dir: Path
    tag: str  # every process and Triton region of this run carries it
    script: subprocess.Popen[bytes] | None = None  # the bash script that started it, if one did

    @property
    def output(self) -> str:
        return self.output_file.read_text() if self.output_file.exists() else ""

    @property
    def launcher(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def url(self, port_name: str) -> str:
        return f"http://127.0.0.1:{self.ports[port_name]}"

    def launcher_alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            return _alive(self.launcher)
        except psutil.Error:
            return False

    def wait_for(self, text: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output:
            assert self.launcher_alive(), f"the launcher exited before {text!r}:\n{self.output}"
            assert time.monotonic() < deadline, f"{text!r} not seen in {timeout}s:\n{self.output}"
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        """The launcher and everything under it (servers, Triton's stubs, the guard)."""
        return [self.launcher, *self.launcher.children(recursive=True)]

    def wait_tree(self, check, timeout: float = START_TIMEOUT_S) -> list[psutil.Process]:
        deadline = time.monotonic() + timeout
        while True:
            tree = self.tree()
            if any(check(proc) for proc in tree):
                return tree
            assert time.monotonic() < deadline, f"not seen in {timeout}s:\n{self.output}"
            time.sleep(0.2)

    def leftovers(self, tree: list[psutil.Process]) -> str:
        """What of this run is still there: processes, bound ports, /dev/shm regions."""
        if self.popen is not None:
            self.popen.poll()  # reap the launcher, so it does not count as a zombie
        processes = {proc.pid: proc for proc in [*tree, *owned_processes(self.tag)] if _alive(proc)}
        ports = [port for port in self.ports.values() if not port_is_free(port)]
        regions = glob.glob(f"/dev/shm/{TRITON_SHM_PREFIX}{self.tag}*")
        if not (processes or ports or regions):
            return ""
        names = []
        for proc in processes.values():
            try:
                names.append(f"{proc.pid} {proc.name()}")
            except psutil.Error:
                pass
        return f"processes {names}, ports {ports}, regions {regions}"

    def clean_within(self, tree: list[psutil.Process], since: float, budget: float = STOP_BUDGET_S) -> float:
        """Seconds from `since` until nothing of the run is left; fails past `budget`."""
        while True:
            left = self.leftovers(tree)
            took = time.monotonic() - since
            if not left:
                return took
            assert took < budget, f"after {took:.1f}s still there: {left}\n{self.output}"
            time.sleep(0.05)

    def finish(self) -> None:
        """Teardown: a launcher a test left running is stopped by its pid (SIGTERM, then
        SIGKILL of its tree); what is left of the run after that fails the session."""
        try:
            tree = self.tree()
            self.launcher.terminate()
            _gone, alive = psutil.wait_procs(tree, timeout=STOP_BUDGET_S + 5)
        except psutil.Error:
            alive = []
        for proc in alive:
            try:
                proc.kill()
            except psutil.Error:
                pass
        for child in (self.popen, self.script):
            if child is not None:
                child.kill()
                child.wait(10)


def start_up(tmp_path: Path, tiny_models: dict[str, Path], *, from_script: bool = False) -> UpRun:
    """`gateway up` on free ports with the tiny models, in its own process group; with
    from_script, started in the background by a bash script (SIGINT inherited as ignored)."""
    ports = _ports()
    tag = f"{os.environ.get(TAG_ENV, '')}u{secrets.token_hex(3)}-"
    env = {
        **os.environ,
        TAG_ENV: tag,
        "STACK_LLM_MODEL": str(tiny_models["gpt2"]),
        "STACK_CLIP_MODEL": str(tiny_models["clip"]),
    }
    data_dir = tmp_path / "data"
    command = _up_command(data_dir, ports)
    output_file = tmp_path / "up.log"
    if not from_script:
        with open(output_file, "wb") as out:
            popen = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return UpRun(popen.pid, popen, output_file, ports, data_dir, tag)
    script = subprocess.Popen(
        ["bash", "-c", _BACKGROUND_SCRIPT, str(output_file), *command], env=env, start_new_session=True
    )
    pid_file = Path(f"{output_file}.pid")
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and script.poll() is None, "the script did not start the launcher"
        time.sleep(0.05)
    return UpRun(int(pid_file.read_text()), None, output_file, ports, data_dir, tag, script=script)


def started_with_sigint_ignored(run: UpRun) -> bool:
    """What the launcher inherited (read by its own process before the exec)."""
    path = Path(f"{run.output_file}.sigign")
    deadline = time.monotonic() + 10
    while not path.exists() or not path.read_text().strip():
        assert time.monotonic() < deadline, "the script did not record the launcher's signal dispositions"
        time.sleep(0.05)
    mask = int(path.read_text().split()[1], 16)
    return bool(mask & (1 << (signal.SIGINT - 1)))


@pytest.fixture
def up_run(tmp_path: Path, tiny_models: dict[str, Path]) -> Iterator[UpRun]:
    run = start_up(tmp_path, tiny_models)
    try:
        yield run
    finally:
        run.finish()


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Iterator[UpRun]:
    """One healthy stack for this module's tests, in order; the last one stops it."""
    run = start_up(tmp_path_factory.mktemp("up"), tiny_models)
    try:
        run.wait_for("press Ctrl-C to stop")
        yield run
    finally:
        run.finish()


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.status


def test_up_starts_every_server_healthy(healthy: UpRun) -> None:
    assert _get(f"{healthy.url('gateway_port')}/readyz") == 200
    assert _get(f"{healthy.url('triton_http_port')}/v2/models/llm/ready") == 200
    names = " ".join(" ".join(proc.cmdline()) for proc in healthy.tree())
    for server in ("tritonserver", "redis-server", "nx-27017", "gateway.cli serve", "binder.cli run"):
        assert server in names


def test_redis_refuses_rather_than_evicts_with_an_eighth_of_the_machines_memory(healthy: UpRun) -> None:
    client = redis.Redis(port=healthy.ports["redis_port"], socket_timeout=5, decode_responses=True)
    config = client.config_get("maxmemory*")
    client.close()
    assert config["maxmemory-policy"] == "noeviction"
    assert int(config["maxmemory"]) == max(GIB, psutil.virtual_memory().total // 8)


def test_redis_maxmemory_auto_is_an_eighth_of_the_memory_and_at_least_1_gib() -> None:
    assert redis_maxmemory("auto", 128 * GIB) == str(16 * GIB)
    assert redis_maxmemory("auto", 4 * GIB) == str(GIB)


def test_a_redis_maxmemory_setting_is_a_redis_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACK_REDIS_MAXMEMORY", "2gb")
    assert redis_maxmemory(StackSettings().redis_maxmemory, 128 * GIB) == "2gb"
    monkeypatch.setenv("STACK_REDIS_MAXMEMORY", "lots")
    with pytest.raises(ValueError, match="redis_maxmemory"):
        StackSettings()


def test_the_data_directory_is_private(healthy: UpRun) -> None:
    data_dir = healthy.data_dir
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    modes = {}
    for path in data_dir.rglob("*"):
        if path.is_symlink():
            continue
        mode = stat.S_IMODE(path.stat().st_mode)
        executable = path.is_dir() or mode & 0o100
        modes[str(path.relative_to(data_dir))] = (mode, 0o700 if executable else 0o600)
    assert {"redis/appendonly.aof", "webhook_secret", "logs/gateway.log"} <= set(modes)
    assert {name: modes for name, modes in modes.items() if modes[0] != modes[1]} == {}


def test_a_killed_binder_is_restarted_and_the_stack_keeps_serving(healthy: UpRun) -> None:
    binder = next(proc for proc in healthy.tree() if "binder.cli" in " ".join(proc.cmdline()))
    gateway = next(proc for proc in healthy.tree() if "gateway.cli serve" in " ".join(proc.cmdline()))
    binder.kill()
    healthy.wait_for("binder is back", timeout=60)
    restarted = next(proc for proc in healthy.tree() if "binder.cli" in " ".join(proc.cmdline()))
    assert restarted.pid != binder.pid
    assert _get(f"{healthy.url('binder_port')}/healthz") == 200
    assert _get(f"{healthy.url('gateway_port')}/readyz") == 200
    assert _alive(gateway)  # the gateway was not taken down with it
    assert "binder exited with signal SIGKILL; restarting in" in healthy.output
    assert "launcher: binder is back" in (healthy.data_dir / "logs" / "binder.log").read_text()


def test_a_killed_redis_is_restarted_from_its_append_only_file(healthy: UpRun) -> None:
    client = redis.Redis(port=healthy.ports["redis_port"], db=63, socket_timeout=5)
    marker = f"before-the-crash-{secrets.token_hex(4)}"
    client.set(marker, "kept")
    aof = healthy.data_dir / "redis" / "appendonly.aof"
    deadline = time.monotonic() + 10
    while marker.encode() not in aof.read_bytes():  # on disk (appendfsync everysec)
        assert time.monotonic() < deadline, "the write never reached the append-only file"
        time.sleep(0.1)
    server = next(proc for proc in healthy.tree() if proc.name() == "redis-server")
    server.kill()
    healthy.wait_for("redis is back", timeout=60)
    assert client.get(marker) == b"kept"
    client.close()
    deadline = time.monotonic() + 60
    while True:  # the gateway reconnects on its own
        try:
            if _get(f"{healthy.url('gateway_port')}/readyz") == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "the gateway did not become ready again"
        time.sleep(0.2)


def test_ctrl_c_to_the_process_group_when_healthy_leaves_no_process_port_or_region(healthy: UpRun) -> None:
    tree = healthy.tree()
    signalled = time.monotonic()
    os.killpg(healthy.pid, signal.SIGINT)
    took = healthy.clean_within(tree, signalled)
    print(f"timing: SIGINT to the process group, healthy: everything gone in {took:.2f}s")
    assert healthy.popen is not None and healthy.popen.wait(timeout=30) == 0  # (gone already; reaped here)
    assert "no process left behind" in healthy.output


class _RepeatingKernel:
    """socket.socket as a kernel that hands the same ephemeral port to binds in a row."""

    ports = iter([41000, 41000, 41000, 41001])

    def __init__(self, *_: object) -> None:
        self.port = 0

    def __enter__(self) -> _RepeatingKernel:
        return self

    def __exit__(self, *_: object) -> None:
        pass

    def bind(self, _: object) -> None:
        self.port = next(self.ports)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self.port


def test_free_ports_in_a_row_differ_even_when_the_kernel_repeats_one(monkeypatch: pytest.MonkeyPatch) -> None:
    from gateway.stack import process

    monkeypatch.setattr(process, "_handed_out", set())
    monkeypatch.setattr(process.socket, "socket", _RepeatingKernel)
    assert [free_port(), free_port()] == [41000, 41001]


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


def _offline_launcher(data_dir: Path, tiny_models: dict[str, Path]) -> LocalStack:
    settings = StackSettings(
        data_dir=data_dir,
        llm_model=str(tiny_models["gpt2"]),
        clip_model=str(tiny_models["clip"]),
        allow_downloads=False,
        device="cpu",
    )
    return LocalStack(settings, log=lambda line: None)


def _environments(launcher: LocalStack) -> dict[str, dict[str, str]]:
    """The environment each server the launcher starts gets (as ManagedProcess builds it)."""
    triton = launcher.triton(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
    binder = binder_spec(data_dir=launcher.data_dir, host="127.0.0.1", port=free_port(), env=launcher.service_env)
    gateway = gateway_spec(data_dir=launcher.data_dir, host="127.0.0.1", port=free_port(), env=launcher.service_env)
    return {spec.name: {**os.environ, **spec.env} for spec in (triton, binder, gateway)}


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_the_servers_the_launcher_starts_never_ask_the_hugging_face_hub(
    tmp_path, tiny_models, monkeypatch, name
) -> None:
    monkeypatch.delenv(name, raising=False)
    environments = _environments(_offline_launcher(tmp_path, tiny_models))
    assert {server: env.get(name) for server, env in environments.items()} == {
        "triton": "1",
        "binder": "1",
        "gateway": "1",
    }


def test_a_hugging_face_offline_setting_of_the_user_is_kept(tmp_path, tiny_models, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    environments = _environments(_offline_launcher(tmp_path, tiny_models))
    assert {env["HF_HUB_OFFLINE"] for env in environments.values()} == {"0"}
