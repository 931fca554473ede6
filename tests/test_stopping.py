"""Stopping and supervising the local stack: a stop request at any moment (start-up,
healthy, under load) ends everything within 10 s, even when `gateway up` was started
in the background by a script (SIGINT inherited as ignored), the gateway first, so it hands
its running requests over while Redis still takes them; a SIGKILLed launcher leaves
nothing behind for more than 10 s; process trees (like Triton's stubs, which ignore
SIGTERM) and their shared memory are cleaned up; a dying child is restarted with
backoff, and one that keeps dying at start makes the launcher give up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from gateway.protocol.redis_keys import shard_of
from gateway.stack import owners
from gateway.stack.owners import TRITON_SHM_PREFIX, shm_regions
from gateway.stack.process import ManagedProcess, ServiceSpec, free_port
from gateway.stack.services import gateway_spec, redis_spec
from gateway.stack.settings import StackSettings
from gateway.stack.stack import LocalStack
from gateway.stack.supervisor import GiveUp, RestartPolicy, Supervisor
from tests.conftest import AUTH
from tests.gateway_calls import llm_body
from tests.test_launcher import UpRun, start_up, started_with_sigint_ignored

PY = sys.executable


def _is_stub(proc: psutil.Process) -> bool:
    try:
        return "triton_python_backend_stub" in " ".join(proc.cmdline()[:1])
    except psutil.Error:
        return False


@pytest.fixture
def runs() -> Iterator[list[UpRun]]:
    started: list[UpRun] = []
    yield started
    for run in started:
        run.finish()


def _starting(run: UpRun) -> list[psutil.Process]:
    """Wait until Triton is loading its models (a python-backend stub runs): mid start-up."""
    return run.wait_tree(_is_stub)


class Load:
    """A few LLM requests running on Triton, and long-polls held open on the gateway."""

    def __init__(self, run: UpRun) -> None:
        key = (run.data_dir / "api_key").read_text().strip()  # made by this run's `gateway up`
        self.client = httpx.Client(
            base_url=run.url("gateway_port"), timeout=30, headers={"Authorization": f"Bearer {key}"}
        )
        self.ids = []
        for i in range(6):
            response = self.client.post("/infer", json=llm_body(f"load {i}", 200))
            assert response.status_code == 202, response.text
            self.ids.append(response.json()["request_id"])
        deadline = time.monotonic() + 60
        while not any(self._status(rid) == "running" for rid in self.ids):
            assert time.monotonic() < deadline, "no request started running"
            time.sleep(0.1)
        self.pool = ThreadPoolExecutor(3)
        self.polls: list[Future] = [
            self.pool.submit(self.client.get, f"/results/{rid}", params={"wait": 10}) for rid in self.ids[-3:]
        ]

    def _status(self, request_id: str) -> str:
        return self.client.get(f"/results/{request_id}").json()["status"]

    def close(self) -> None:
        self.pool.shutdown(wait=True)  # the stack is gone: each poll ends at once
        self.client.close()


def _stop(run: UpRun, tree: list[psutil.Process], how: str, case: str) -> float:
    """Send the stop request; seconds until no process, port or region of the run is left."""
    signalled = time.monotonic()
    if how == "SIGINT to the process group":
        os.killpg(os.getpgid(run.pid), signal.SIGINT)
    elif how == "SIGTERM":
        os.kill(run.pid, signal.SIGTERM)
    else:
        os.kill(run.pid, signal.SIGKILL)
    took = run.clean_within(tree, signalled)
    print(f"timing: {how}, {case}: everything gone in {took:.2f}s")
    return took


# -- stop requests, end to end -------------------------------------------------------------


def test_ctrl_c_during_start_up_of_a_background_started_launcher_stops_everything(
    tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]
) -> None:
    run = start_up(tmp_path, tiny_models, from_script=True)
    runs.append(run)
    assert started_with_sigint_ignored(run)  # what CI and systemd-like wrappers hand down
    tree = _starting(run)
    _stop(run, tree, "SIGINT to the process group", "start-up")
    assert "SIGINT received" in run.output
    assert "no process left behind" in run.output


def test_sigterm_during_start_up_stops_everything(
    tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]
) -> None:
    run = start_up(tmp_path, tiny_models)
    runs.append(run)
    tree = _starting(run)
    _stop(run, tree, "SIGTERM", "start-up")
    assert run.popen is not None and run.popen.wait(timeout=30) == 0  # (gone: clean_within saw it; reaped here)
    assert "all healthy" not in run.output


def test_sigterm_when_healthy_stops_everything(tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]) -> None:
    run = start_up(tmp_path, tiny_models)
    runs.append(run)
    run.wait_for("press Ctrl-C to stop")
    _stop(run, run.tree(), "SIGTERM", "healthy")
    assert run.popen is not None and run.popen.wait(timeout=30) == 0  # (gone: clean_within saw it; reaped here)


def test_ctrl_c_under_load_of_a_background_started_launcher_stops_everything(
    tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]
) -> None:
    run = start_up(tmp_path, tiny_models, from_script=True)
    runs.append(run)
    run.wait_for("press Ctrl-C to stop")
    load = Load(run)
    try:
        _stop(run, run.tree(), "SIGINT to the process group", "under load")
    finally:
        load.close()
    assert "no process left behind" in run.output


def test_sigterm_under_load_stops_everything(tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]) -> None:
    run = start_up(tmp_path, tiny_models)
    runs.append(run)
    run.wait_for("press Ctrl-C to stop")
    load = Load(run)
    try:
        _stop(run, run.tree(), "SIGTERM", "under load")
    finally:
        load.close()
    assert run.popen is not None and run.popen.wait(timeout=30) == 0  # (gone: clean_within saw it; reaped here)


def test_no_child_outlives_a_sigkilled_launcher_by_more_than_10s(
    tmp_path: Path, tiny_models: dict[str, Path], runs: list[UpRun]
) -> None:
    run = start_up(tmp_path, tiny_models)
    runs.append(run)
    run.wait_for("press Ctrl-C to stop")
    load = Load(run)
    tree = run.tree()
    assert any(_is_stub(proc) for proc in tree)
    try:
        _stop(run, tree, "SIGKILL", "under load")
    finally:
        load.close()


# A generation of several seconds (a token per 20 ms): still running when the stop comes.
STILL_RUNNING = {
    "model": "llm_synthetic",
    "inputs": {"text_input": "still running at the stop", "max_tokens": 500},
    "stream": True,
}


def test_a_launcher_stop_lets_the_gateway_hand_its_running_request_over_before_redis_stops(
    stack, tmp_path: Path
) -> None:
    # A launcher of its own Redis and gateway (the session's MongoDB and Triton), in start
    # order, as `gateway up` has them; its stop is the one Ctrl-C makes.
    data = tmp_path / "data"
    redis_port, gateway_port = free_port(), free_port()
    launcher = LocalStack(StackSettings(data_dir=data, allow_downloads=False), log=lambda line: None)
    env = {**stack.launcher.service_env, "REDIS_URL": f"redis://127.0.0.1:{redis_port}/0"}
    try:
        launcher.start_service(redis_spec(data_dir=data, host="127.0.0.1", port=redis_port))
        launcher.start_service(gateway_spec(data_dir=data, host="127.0.0.1", port=gateway_port, env=env))
        with httpx.Client(base_url=f"http://127.0.0.1:{gateway_port}", headers=AUTH, timeout=30) as client:
            submitted = client.post("/infer", json=STILL_RUNNING)
            assert submitted.status_code == 202, submitted.text
            request_id = submitted.json()["request_id"]
            deadline = time.monotonic() + 60
            while client.get(f"/results/{request_id}").json()["status"] != "running":
                assert time.monotonic() < deadline, "the request never started"
                time.sleep(0.05)
    finally:
        launcher.stop()
    # What Redis kept (its append-only file): the request waits at the front of the line
    # for another gateway, no longer held by the one that stopped.
    again = ManagedProcess(redis_spec(data_dir=data, host="127.0.0.1", port=redis_port))
    again.start()
    try:
        again.wait_ready(time.monotonic() + 60)
        client = redis.Redis(port=redis_port, decode_responses=True, socket_timeout=5)
        shard = shard_of(request_id)
        assert client.lrange(shard.reclaimed("llm_synthetic"), 0, -1) == [request_id]
        assert client.hget(shard.request(request_id), "owner") is None
        client.close()
    finally:
        again.stop()


# -- the mechanisms, on small real processes -----------------------------------------------

# A parent that maps a shared-memory region and starts a child that ignores SIGTERM, in a
# session of its own (like Triton and its python-backend stubs).
_TREE = """
import mmap, os, signal, subprocess, sys, time
fd = os.open("/dev/shm/" + sys.argv[1] + "r1", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
region = mmap.mmap(fd, 4096)
stub = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(600)"
subprocess.Popen([sys.executable, "-c", stub], start_new_session=True)
time.sleep(600)
"""


def _tree_spec(tmp_path: Path) -> ServiceSpec:
    spec = ServiceSpec(name="tree", argv=[], log_file=tmp_path / "tree.log")
    spec.shm_prefix = f"{TRITON_SHM_PREFIX}{spec.owner}_"
    spec.argv = [PY, "-c", _TREE, spec.shm_prefix]
    spec.ready = lambda: "up" in spec.log_file.read_text()
    return spec


@pytest.fixture
def foreign_region() -> Iterator[Path]:
    """A region of a Triton we did not start: never to be touched."""
    path = Path("/dev/shm") / f"{TRITON_SHM_PREFIX}not-ours-{os.getpid()}"
    path.write_bytes(b"x")
    yield path
    path.unlink(missing_ok=True)


def test_stop_kills_the_whole_tree_and_removes_only_its_own_regions(tmp_path: Path, foreign_region: Path) -> None:
    process = ManagedProcess(_tree_spec(tmp_path))
    process.start()
    process.wait_ready(time.monotonic() + 30)
    tree = [psutil.Process(process.pid), *process.descendants()]
    assert len(tree) == 2 and shm_regions(process.spec.shm_prefix or "")
    started = time.monotonic()
    process.stop(grace=1.0)
    assert time.monotonic() - started < 5
    assert not [proc.pid for proc in tree if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE]
    assert shm_regions(process.spec.shm_prefix or "") == []
    assert foreign_region.exists()


def test_after_a_crash_the_orphaned_children_are_found_by_owner_and_killed(tmp_path: Path) -> None:
    process = ManagedProcess(_tree_spec(tmp_path))
    process.start()
    process.wait_ready(time.monotonic() + 30)
    (stub,) = process.descendants()
    assert process.pid is not None
    os.kill(process.pid, signal.SIGKILL)  # the parent crashes; its child is reparented
    assert process.popen is not None and process.popen.wait(10) == -signal.SIGKILL
    assert stub.is_running() and stub.ppid() != process.pid
    process.cleanup()
    assert not stub.is_running() or stub.status() == psutil.STATUS_ZOMBIE
    assert shm_regions(process.spec.shm_prefix or "") == []


def test_a_killed_process_its_parent_never_reaps_counts_as_ended(tmp_path: Path) -> None:
    # As a Triton stub reparented to a container's first process: killed, it stays a zombie.
    code = (
        "import subprocess, sys, time; "
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print(child.pid, flush=True); time.sleep(600)"
    )
    parent = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout is not None
        child = psutil.Process(int(parent.stdout.readline()))
        assert owners._kill([child]) == []
        assert child.status() == psutil.STATUS_ZOMBIE
    finally:
        parent.kill()
        parent.wait()


def _sleeper(tmp_path: Path, code: str = "import time; print('up', flush=True); time.sleep(600)") -> ManagedProcess:
    spec = ServiceSpec(name="sleeper", argv=[PY, "-c", code], log_file=tmp_path / "sleeper.log")
    spec.ready = lambda: "up" in spec.log_file.read_text()
    return ManagedProcess(spec)


FAST = RestartPolicy(first_delay_s=0.05, max_delay_s=0.2, ready_timeout_s=30, poll_s=0.05)


def test_a_child_that_dies_is_restarted_with_backoff_and_reported(tmp_path: Path) -> None:
    process = _sleeper(tmp_path)
    process.start()
    process.wait_ready(time.monotonic() + 30)
    first = process.pid
    lines: list[str] = []
    supervisor = Supervisor([process], FAST, log=lines.append)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    supervisor.run(until=lambda: any("is back" in line for line in lines) or time.monotonic() > deadline)
    try:
        assert process.running and process.pid != first
        assert lines[0].startswith("!! sleeper exited with signal SIGKILL; restarting in 0.05s")
        log = process.spec.log_file.read_text()
        assert "launcher: sleeper exited with signal SIGKILL" in log and "launcher: sleeper is back" in log
    finally:
        process.stop()


def test_a_child_that_keeps_dying_at_start_makes_the_supervisor_give_up(tmp_path: Path) -> None:
    process = _sleeper(tmp_path, "import sys; sys.exit(3)")
    process.start()
    lines: list[str] = []
    supervisor = Supervisor([process], FAST, log=lines.append)
    started = time.monotonic()
    with pytest.raises(GiveUp, match="died 5 times in a row"):
        supervisor.run(until=lambda: time.monotonic() - started > 30)
    delays = [line.split("restarting in ")[1].split("s ")[0] for line in lines if "restarting in" in line]
    assert delays == ["0.05", "0.10", "0.20", "0.20"]  # doubling, up to the cap
    assert not process.running
