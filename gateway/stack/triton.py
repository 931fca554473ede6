"""Run the tritonserver binary bundled in the nvidia-pytriton wheel on a model repository.

The wheel holds the server, the python backend and one python-backend stub per Python
version. The stub must match the running interpreter, so the backend folder is
assembled in the data directory: the backend's files plus the matching stub.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import sysconfig
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from gateway.stack.devices import Device, threads_per_instance
from gateway.stack.owners import TRITON_SHM_PREFIX, new_owner
from gateway.stack.process import LaunchError, ServiceSpec, make_private_tree
from gateway.stack.weights import offline_env


@dataclass(frozen=True)
class TritonInstall:
    server_bin: Path
    backends_src: Path
    stub: Path
    caches: Path
    libs: Path

    @classmethod
    def find(cls) -> TritonInstall:
        spec = importlib.util.find_spec("pytriton")
        if spec is None or not spec.submodule_search_locations:
            raise LaunchError(
                "tritonserver not found: install the local extra (`make up` does it: pip install -e '.[local]')"
            )
        root = Path(next(iter(spec.submodule_search_locations))) / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        install = cls(
            server_bin=root / "bin" / "tritonserver",
            backends_src=root / "backends",
            stub=root / "python_backend_stubs" / version / "triton_python_backend_stub",
            caches=root / "caches",
            libs=root.parent.parent / "nvidia_pytriton.libs",
        )
        if not install.server_bin.exists():
            raise LaunchError(f"tritonserver binary missing at {install.server_bin}: reinstall nvidia-pytriton")
        if not install.stub.exists():
            raise LaunchError(f"no Triton python-backend stub for Python {version}: use Python 3.8 to 3.13")
        return install

    def backend_dir(self, data_dir: Path) -> Path:
        """The backend folder with the stub for this interpreter (made once, reused)."""
        target = data_dir / "triton_backends"
        python_dir = target / "python"
        if not (python_dir / "triton_python_backend_stub").exists():
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(self.backends_src, target)
            shutil.copy2(self.stub, python_dir / "triton_python_backend_stub")
            make_private_tree(target)
        return target

    @staticmethod
    def libpython_dir(data_dir: Path) -> Path:
        """A folder holding only this interpreter's libpython (a link), for the stub.

        Not the interpreter's LIBDIR itself: for a system Python that is the system's library
        folder (/usr/lib/x86_64-linux-gnu), and on LD_LIBRARY_PATH it shadowed the CUDA
        libraries torch ships with (LD_LIBRARY_PATH comes before their RUNPATH) by the
        system's, whose kernels ran the LLM engine's decode step 1.5x slower on an H100
        (bench.engine_bench under the stub's environment, docs/benchmarks.md)."""
        libdir, name = sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME")
        target = data_dir / "triton_libpython"
        if not libdir or not name or not (Path(libdir) / name).exists():
            return Path(libdir or target)  # (no shared libpython to link: the folder, as before)
        link = target / name
        if not link.is_symlink() or link.resolve() != (Path(libdir) / name).resolve():
            target.mkdir(parents=True, exist_ok=True)
            link.unlink(missing_ok=True)
            link.symlink_to(Path(libdir) / name)
        return target

    def environment(self, device: Device, data_dir: Path) -> dict[str, str]:
        # The stub links the bundled libraries and libpython; it runs our models with
        # this environment's packages (numpy < 2, torch, transformers).
        lib_dirs = [str(self.libs), str(self.libpython_dir(data_dir))]
        env = {
            "LD_LIBRARY_PATH": ":".join(d for d in lib_dirs if d),
            # The stub's embedded interpreter ignores PYTHONPATH; it finds its prefix from
            # the first `python3` on PATH, so ours (a venv's) comes first.
            "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
            "TOKENIZERS_PARALLELISM": "false",
            # The models load from local directories: no Hugging Face hub (unless the user says).
            **offline_env(),
        }
        # Torch in each stub: let Triton's instances share the cores instead of each taking
        # all (on cuda the towers run several instances: devices.gpu_instances).
        env["OMP_NUM_THREADS"] = "1" if device == "cpu" else str(threads_per_instance())
        return env


def triton_spec(
    *,
    name: str,
    model_repo: Path,
    data_dir: Path,
    host: str,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    extra_env: dict[str, str] | None = None,
    device: Device = "cpu",
    twins: bool = True,
) -> ServiceSpec:
    """twins: load the repository's `*_nondecoupled` models at start too (the TensorRT-LLM
    contract's ModelInfer twins, which only its own clients call); without, Triton loads
    them when asked for (its repository API: load_twins)."""
    install = TritonInstall.find()
    models = startup_models(model_repo, twins=twins)
    # Its python backend's shared-memory regions carry this Triton's owner token, so the
    # launcher removes exactly them once the Triton and its stubs are gone.
    owner = new_owner()
    shm_prefix = f"{TRITON_SHM_PREFIX}{owner}_"
    argv = [
        str(install.server_bin),
        f"--model-repository={model_repo}",
        f"--backend-directory={install.backend_dir(data_dir)}",
        f"--cache-directory={install.caches}",
        f"--http-address={host}",
        f"--http-port={http_port}",
        f"--grpc-address={host}",
        f"--grpc-port={grpc_port}",
        f"--metrics-address={host}",
        f"--metrics-port={metrics_port}",
        "--allow-cpu-metrics=false",
        "--allow-gpu-metrics=false",
        f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
        # How long Triton waits for running requests on SIGTERM; the launcher's grace ends it anyway.
        "--exit-timeout-secs=3",
        "--log-verbose=0",
        # The models named load at start, all of them at once (Triton's default loads four
        # at a time); the others when asked for.
        "--model-control-mode=explicit",
        # Ready while it serves, whatever model loads meanwhile (a twin asked for later must
        # not make the whole server read as not ready: the gateways look at each model).
        "--strict-readiness=false",
        *(f"--load-model={model}" for model in models),
        f"--model-load-thread-count={max(1, len(models))}",
    ]
    return ServiceSpec(
        name=name,
        argv=argv,
        log_file=data_dir / "logs" / f"{name}.log",
        ports=[(http_port, "Triton HTTP"), (grpc_port, "Triton gRPC"), (metrics_port, "Triton metrics")],
        env={**install.environment(device, data_dir), **(extra_env or {})},
        ready=lambda: triton_models_ready(f"http://{host}:{http_port}", models),
        url=f"grpc://{host}:{grpc_port}  http://{host}:{http_port}  metrics http://{host}:{metrics_port}/metrics",
        owner=owner,
        shm_prefix=shm_prefix,
        # Stopped last, once the gateways are gone: nothing runs on it any more, and it keeps
        # nothing on disk, so unloading its models gracefully is not worth the wait (its stubs
        # and shared memory are cleaned up after the kill).
        stop_grace_s=1.0,
    )


class ModelLoadFailed(LaunchError):
    pass


TWIN_SUFFIX = "_nondecoupled"


def startup_models(model_repo: Path, *, twins: bool) -> list[str]:
    """The models of a repository Triton loads at start: all, or all but the twins."""
    names = sorted(path.parent.name for path in model_repo.glob("*/config.pbtxt"))
    return [name for name in names if twins or not name.endswith(TWIN_SUFFIX)]


def load_twins(http_url: str, model_repo: Path, timeout_s: float = 300) -> list[str]:
    """Ask a Triton started without its twins to load them (each call returns once the
    model is READY or failed); the names loaded."""
    twins = [name for name in startup_models(model_repo, twins=True) if name.endswith(TWIN_SUFFIX)]
    for name in twins:
        request = urllib.request.Request(f"{http_url}/v2/repository/models/{name}/load", data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            if resp.status != 200:
                raise ModelLoadFailed(f"Triton could not load model {name}: HTTP {resp.status}")
    return twins


def triton_models_ready(http_url: str, models: list[str] | None = None) -> bool:
    """True when the server is ready and every model named (all in the repository when
    None) is READY.

    Raises ModelLoadFailed as soon as one of them is UNAVAILABLE, with Triton's reason."""
    try:
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=2) as resp:
            if resp.status != 200:
                return False
    except OSError:
        return False
    request = urllib.request.Request(f"{http_url}/v2/repository/index", data=b"{}", method="POST")
    with urllib.request.urlopen(request, timeout=5) as resp:
        index = json.loads(resp.read())
    wanted = [model for model in index if models is None or model["name"] in models]
    for model in wanted:
        if model.get("state") == "UNAVAILABLE":
            raise ModelLoadFailed(f"Triton could not load model {model['name']}: {model.get('reason', '')}")
    return bool(wanted) and all(model.get("state") == "READY" for model in wanted)
