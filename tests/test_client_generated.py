"""The synchronous client is generated from the asynchronous one (tools/unasync_client.py):
sync.py must be exactly what the generator makes of aio.py, so the two cannot drift apart.
After editing aio.py, run `.venv/bin/python tools/unasync_client.py`."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

from gateway.client import AsyncGatewayClient, GatewayClient

ROOT = Path(__file__).resolve().parents[1]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("unasync_client", ROOT / "tools" / "unasync_client.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_py_is_what_the_generator_makes_of_aio_py() -> None:
    generator = _generator()
    expected = generator.generate()
    actual = generator.TARGET.read_text()
    assert actual == expected, "gateway/client/sync.py is out of date: run .venv/bin/python tools/unasync_client.py"


def test_both_clients_have_the_same_methods_with_the_same_parameters() -> None:
    def public(cls: type) -> dict[str, list[str]]:
        return {
            name: list(inspect.signature(member).parameters)
            for name, member in vars(cls).items()
            if callable(member) and not (name.startswith("_") and not name.startswith("__"))
        }

    renamed = {"__aenter__": "__enter__", "__aexit__": "__exit__", "aclose": "close"}
    asynchronous = {renamed.get(name, name): params for name, params in public(AsyncGatewayClient).items()}
    assert asynchronous == public(GatewayClient)
    for name in ("submit", "result", "wait", "events", "stream_text", "cancel", "search", "generate", "close"):
        assert not inspect.iscoroutinefunction(getattr(GatewayClient, name))
