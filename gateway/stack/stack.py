"""The local stack: Redis, the MongoDB-wire server, Triton, the binder and the gateway,
started in order, each waited on until healthy, and stopped in reverse order by pid.

`gateway up` runs this; the tests start their servers through it too."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from gateway.stack import weights
from gateway.stack.process import LaunchError, ManagedProcess, ServiceSpec
from gateway.stack.services import binder_spec, gateway_spec, mongo_spec, redis_spec
from gateway.stack.settings import StackSettings
from gateway.stack.triton import triton_spec

# Which environment variable names the weights directory of which model family.
_WEIGHT_ENV = {"LLM_MODEL_DIR": "llm", "CLIP_MODEL_DIR": "clip"}


def prepare_model_repo(source: Path, target: Path, notes: dict[str, str]) -> Path:
    """Copy the model repository and record in each model's config where its weights
    come from (`weights` parameter, shown by Triton's /v2/models/<m>/config)."""
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for config_path in target.glob("*/config.pbtxt"):
        config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
        model_dir = config.parameters["model_dir"].string_value if "model_dir" in config.parameters else ""
        for env_name, family in _WEIGHT_ENV.items():
            if env_name in model_dir:
                config.parameters["weights"].string_value = notes[family]
        config_path.write_text(text_format.MessageToString(config))
    return target


class LocalStack:
    def __init__(
        self,
        settings: StackSettings,
        log: Callable[[str], None] = print,
        service_overrides: dict[str, str] | None = None,
    ) -> None:
        """service_overrides: extra environment for the gateway and binder processes."""
        self.settings = settings
        self.log = log
        self.service_overrides = service_overrides or {}
        self.data_dir = settings.data_dir.resolve()
        self.processes: list[ManagedProcess] = []
        self.model_weights: dict[str, weights.Weights] = {}

    # -- plan -------------------------------------------------------------------------

    @property
    def mongo_url(self) -> str:
        s = self.settings
        return s.mongo_url or f"mongodb://{s.host}:{s.mongo_port}"

    @property
    def service_env(self) -> dict[str, str]:
        """What the gateway and binder need to find the servers."""
        s = self.settings
        return {
            "REDIS_URL": f"redis://{s.host}:{s.redis_port}/0",
            "MONGO_URL": self.mongo_url,
            "TRITON_GRPC_URLS": f"{s.host}:{s.triton_grpc_port}",
            "BINDER_URLS": f"http://{s.host}:{s.binder_port}",
            "WEBHOOK_SECRETS": os.environ.get("WEBHOOK_SECRETS") or self.webhook_secret(),
            **self.service_overrides,
        }

    def webhook_secret(self) -> str:
        """A signing secret kept in the data directory, made on first use."""
        path = self.data_dir / "webhook_secret"
        if not path.exists():
            self.data_dir.mkdir(parents=True, exist_ok=True)
            path.write_text("whsec_" + base64.b64encode(os.urandom(24)).decode())
            path.chmod(0o600)
        return path.read_text().strip()

    def weight_env(self) -> dict[str, str]:
        """Find (or build) the weights once; the environment that points Triton at them."""
        if not self.model_weights:
            s = self.settings
            demo_dir = self.data_dir / "models"
            for family, model, kind in (("llm", s.llm_model, "gpt2"), ("clip", s.clip_model, "clip")):
                found = weights.resolve(model, kind=kind, demo_dir=demo_dir, allow_downloads=s.allow_downloads)
                self.model_weights[family] = found
                if found.demo:
                    self.log(f"!! {family}: serving a DEMO model ({found.source}): {found.path}")
                    self.log(f"!!   {weights.DEMO_NOTE}")
                else:
                    self.log(f"   {family}: {found.description}")
        return {
            "LLM_MODEL_DIR": str(self.model_weights["llm"].path),
            "CLIP_MODEL_DIR": str(self.model_weights["clip"].path),
        }

    def triton(self, name: str = "triton", *, http_port: int, grpc_port: int, metrics_port: int) -> ServiceSpec:
        env = self.weight_env()
        notes = {family: w.description for family, w in self.model_weights.items()}
        repo = prepare_model_repo(self.settings.model_repo, self.data_dir / f"model_repo_{name}", notes)
        return triton_spec(
            name=name,
            model_repo=repo,
            data_dir=self.data_dir,
            host=self.settings.host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            extra_env=env,
        )

    def plan(self) -> list[Callable[[], ServiceSpec]]:
        """Spec factories in start order (factories, so slow steps run at start time)."""
        s = self.settings
        steps: list[Callable[[], ServiceSpec]] = [
            lambda: redis_spec(data_dir=self.data_dir, host=s.host, port=s.redis_port),
        ]
        if not s.mongo_url:
            steps.append(lambda: mongo_spec(data_dir=self.data_dir, host=s.host, port=s.mongo_port))
        steps.append(
            lambda: self.triton(
                http_port=s.triton_http_port, grpc_port=s.triton_grpc_port, metrics_port=s.triton_metrics_port
            )
        )
        if s.start_binder:
            steps.append(
                lambda: binder_spec(data_dir=self.data_dir, host=s.host, port=s.binder_port, env=self.service_env)
            )
        if s.start_gateway:
            steps.append(
                lambda: gateway_spec(data_dir=self.data_dir, host=s.host, port=s.gateway_port, env=self.service_env)
            )
        return steps

    # -- run --------------------------------------------------------------------------

    def start_service(self, spec: ServiceSpec) -> ManagedProcess:
        started = time.monotonic()
        process = ManagedProcess(spec)
        process.start()
        self.processes.append(process)
        process.wait_ready(time.monotonic() + self.settings.startup_timeout_s)
        self.log(f"   {spec.name:<8} ready in {time.monotonic() - started:5.1f}s  pid {process.pid:<7} {spec.url}")
        return process

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        try:
            for make_spec in self.plan():
                self.start_service(make_spec())
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()
        self.processes.clear()

    def all_pids(self) -> list[int]:
        """Our children and their descendants (e.g. Triton's python-backend stubs)."""
        pids = []
        for process in self.processes:
            if process.pid is not None:
                pids.append(process.pid)
                pids.extend(child.pid for child in process.descendants())
        return pids

    def run_until_signal(self) -> int:
        """Block until Ctrl-C / SIGTERM (exit 0) or until a server dies (exit 1)."""
        stop_requested = False

        def request_stop(signum: int, frame: object) -> None:
            nonlocal stop_requested
            stop_requested = True

        previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            while not stop_requested:
                for process in self.processes:
                    code = process.exit_code()
                    if code is not None:
                        self.log(f"!! {process.spec.name} exited with code {code}; see {process.spec.log_file}")
                        return 1
                time.sleep(0.5)
            return 0
        finally:
            self.log("stopping...")
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self.log("stopped; no process left behind")


def start_or_explain(stack: LocalStack) -> None:
    """Start the stack; a LaunchError becomes the one-line message it carries."""
    try:
        stack.start()
    except LaunchError as exc:
        raise SystemExit(f"error: {exc}") from None
