"""Generate the synchronous client (gateway/client/sync.py) from the asynchronous one
(gateway/client/aio.py) with `unasync`, as httpcore keeps its sync twin: edit aio.py, then
run `.venv/bin/python tools/unasync_client.py` (tests/test_client_generated.py fails while
sync.py is not what this produces; `--check` does the same from the command line).

unasync drops `async`/`await` (so `async with`/`async for` become `with`/`for`) and renames
tokens by the table below; a few phrases of the docstrings are then rewritten as text, each
of which must occur exactly once (so a reworded aio.py fails loudly here, not silently in
the sync docs). The result is formatted with ruff, as the rest of the code is."""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import unasync

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "gateway" / "client" / "aio.py"
TARGET = ROOT / "gateway" / "client" / "sync.py"

# Token renames on top of unasync's own (__aenter__, __aexit__, AsyncIterator, ...).
TOKENS = {
    "AsyncGatewayClient": "GatewayClient",
    "AsyncClient": "Client",  # httpx.AsyncClient
    "aclose": "close",
    "aread": "read",
    "aconnect_sse": "connect_sse",  # httpx_sse
    "aiter_sse": "iter_sse",
    "asyncio": "time",  # `import asyncio` and `asyncio.sleep(...)`
}

# Prose (docstrings) that has to read differently: (in aio.py, in sync.py).
PHRASES = [
    (
        '"""The asynchronous client (the same API as the synchronous one, awaited)."""',
        "# Generated from gateway/client/aio.py by tools/unasync_client.py: edit aio.py, not this file.\n"
        '"""The synchronous client (the same API as the asynchronous one, not awaited)."""',
    ),
    (
        "Asynchronous client. Use it as an async context manager, or await aclose().",
        "Synchronous client. Use it as a context manager, or call close().",
    ),
    ("an async iterator of its pieces", "an iterator of its pieces"),
    ("`async for piece in await client.generate(", "`for piece in client.generate("),
    ("submitted by the await", "submitted by the call"),
]


def generate(source: Path = SOURCE) -> str:
    """The synchronous client's source, as it should be in sync.py."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sync.py"
        rule = unasync.Rule(fromdir=str(source), todir=str(out), additional_replacements=TOKENS)
        unasync.unasync_files([str(source)], rules=[rule])
        text = out.read_text()
    for old, new in PHRASES:
        if text.count(old) != 1:
            raise SystemExit(f"{source.name} no longer has this text exactly once (update PHRASES):\n{old}")
        text = text.replace(old, new)
    return _format(text)


def _format(text: str) -> str:
    ruff = Path(sys.executable).with_name("ruff")
    done = subprocess.run(
        [str(ruff) if ruff.exists() else "ruff", "format", "--stdin-filename", str(TARGET), "-"],
        input=text,
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if sync.py is not up to date; write nothing")
    args = parser.parse_args()
    text = generate()
    if args.check:
        if TARGET.read_text() != text:
            raise SystemExit(f"{TARGET.relative_to(ROOT)} is out of date: run python tools/unasync_client.py")
        return
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
