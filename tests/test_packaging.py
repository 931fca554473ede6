"""The package as users install it: the wheel holds every code folder, the UI's files and
the deployable files (inside gateway/assets/), and the client needs none of the server's
dependencies."""

from __future__ import annotations

import ast
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Build:
    wheel: Path
    output: str  # what the build printed (pip quiet: only the backend's warnings and errors)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Build:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    (built,) = out.glob("triton_gateway-*.whl")
    return Build(built, done.stdout + done.stderr)


@pytest.fixture(scope="module")
def wheel(build: Build) -> zipfile.ZipFile:
    return zipfile.ZipFile(build.wheel)


def test_building_the_wheel_prints_no_warnings(build: Build) -> None:
    # setuptools warned "Package would be ignored" for every folder of the assets (~700
    # lines on `make up` from a fresh clone).
    assert "would be ignored" not in build.output
    warnings = [line for line in build.output.splitlines() if "warning" in line.lower()]
    assert warnings == []


def test_the_wheel_holds_every_python_package_folder(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for top in ("gateway", "binder"):
        for init in (ROOT / top).rglob("__init__.py"):
            assert init.relative_to(ROOT).as_posix() in names


def test_the_wheel_holds_the_deployable_files_and_the_page(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for path in (
        "gateway/assets/model_repo/local/llm_engine/config.pbtxt",
        "gateway/assets/model_repo/trtllm/trtllm_tensorrt_llm/config.pbtxt",
        "gateway/assets/compose/deployment.toml",
        "gateway/assets/nginx/nginx.conf",
        "gateway/server/ui/index.html",
    ):
        assert path in names, path


def test_the_client_imports_nothing_of_the_server_stack() -> None:
    """gateway.client and gateway.protocol import only the client's dependencies."""
    # (pydantic_core is pydantic's own, installed with it)
    client_deps = {"httpx", "httpx_sse", "pydantic", "pydantic_core", "typer", "rich"}
    stdlib = set(sys.stdlib_module_names)
    for folder in ("client", "protocol"):
        for path in (ROOT / "gateway" / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    assert top in stdlib | client_deps | {"gateway"}, f"{path.name} imports {name}"
                    if top == "gateway":
                        assert name.startswith(("gateway.client", "gateway.protocol")), f"{path.name} imports {name}"
