"""The package as users install it: every code folder is in the wheel, the client needs
none of the server's dependencies, and the deployable files ship inside the package."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _declared_packages() -> set[str]:
    return set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def test_every_python_package_folder_is_declared_for_the_wheel() -> None:
    found = {
        ".".join(init.parent.relative_to(ROOT).parts)
        for top in ("gateway", "binder")
        for init in (ROOT / top).rglob("__init__.py")
    }
    assert found - _declared_packages() == set()


def test_the_client_imports_nothing_of_the_server_stack() -> None:
    """gateway.client and gateway.protocol import only the client's dependencies."""
    client_deps = {"httpx", "httpx_sse", "pydantic", "typer", "rich"}
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
