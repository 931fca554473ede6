"""How much of the gateway one request runs through: the files of gateway/ whose code runs
for it, the lines of those files (what a reader opens to follow it), and the lines that
run. Two requests: `POST /infer` with one `clip_text` input (Prefer: wait), and a
`POST /v1/chat/completions` to `llm` (not streamed, 4 tokens).

How it is counted:
- a local stack as the tests start it (tests/conftest.py: the tiny models, free ports),
  without its gateway; a gateway served in this process instead (create_app under uvicorn
  with gateway/server/serve.py's HTTP protocol, as `gateway serve` runs it, on the
  pure-Python asyncio loop);
- the app wrapped so a traced request runs in a context marked as its own. Every task,
  callback and future callback it causes runs in a copy of that context (what
  REQUEST_COUNTS relies on: gateway/common/counts.py), so a trace function (sys.settrace)
  that keeps what runs under gateway/ while the mark is set sees the request's work
  wherever in the process it runs (the dispatcher's task of its run, the shared Triton
  call), and not the background loops (probes, sweeps, snapshots). The HTTP protocol's
  callbacks run in the connection's context: gateway/server/serve.py is counted while the
  traced request is open;
- each request is sent twice untraced first (lazy imports, caches, the first model
  configs), then once traced; the trace lasts until the response has come and nothing
  has run in the request's context for QUIET_S (work it leaves behind, such as its
  record being stored, counts);
- threads: the trace is set for threads started while it runs, and the loop's default
  executor is replaced just before, so work handed to asyncio.to_thread is counted; a
  pool started earlier (gateway/server/models/tokenize_pool.py's, for long inputs only)
  is not.

Run:  .venv/bin/python -m bench.footprint            (both requests)
      .venv/bin/python -m bench.footprint --files    (and the files, with their lines)
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextvars
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = str(ROOT / "gateway") + os.sep
PROTOCOL = str(ROOT / "gateway" / "server" / "serve.py")
HEADER = b"x-footprint"
# The trace ends once nothing has run in the request's context for this long.
QUIET_S = 0.5

_traced: contextvars.ContextVar[bool] = contextvars.ContextVar("footprint_traced", default=False)

REQUESTS: dict[str, tuple[str, dict[str, Any], dict[str, str]]] = {
    "POST /infer (one clip_text input)": (
        "/infer",
        {"model": "clip_text", "inputs": {"text": "a photo of a cat"}},
        {"prefer": "wait=30"},
    ),
    "POST /v1/chat/completions (llm, 4 tokens)": (
        "/v1/chat/completions",
        {"model": "llm", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4},
        {},
    ),
}


@dataclass
class Trace:
    """The lines run under gateway/ in the traced request's context."""

    lines: dict[str, set[int]] = field(default_factory=dict)
    open: bool = False  # the traced request is being sent or answered
    last: float = 0.0  # when its context last ran code

    def local(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        if event == "line" and (_traced.get() or (self.open and frame.f_code.co_filename == PROTOCOL)):
            self.lines.setdefault(frame.f_code.co_filename, set()).add(frame.f_lineno)
            self.last = time.monotonic()
        return self.local

    def call(self, frame: FrameType, event: str, arg: Any) -> Callable[..., Any] | None:
        """The global trace function: lines are traced in gateway/'s frames only."""
        return self.local if frame.f_code.co_filename.startswith(PACKAGE) else None


def marked(app: Any) -> Any:
    """The ASGI app, a request with the x-footprint header served in a marked context."""

    async def serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and any(name == HEADER for name, _ in scope.get("headers", [])):
            _traced.set(True)  # this task's own context, copied by every task it starts
        await app(scope, receive, send)

    return serve


def size(path: str) -> int:
    return len(Path(path).read_text().splitlines())


async def measure(url: str, api_key: str, name: str, show_files: bool) -> str:
    path, body, headers = REQUESTS[name]
    headers = {**headers, "authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for _ in range(2):  # warm
            (await client.post(path, json=body, headers=headers)).raise_for_status()
    loop = asyncio.get_running_loop()
    loop.set_default_executor(concurrent.futures.ThreadPoolExecutor())
    trace = Trace()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:  # a connection of its own
        threading.settrace(trace.call)
        sys.settrace(trace.call)
        trace.open = True
        try:
            response = await client.post(path, json=body, headers={**headers, HEADER.decode(): "1"})
            trace.open = False
            while time.monotonic() - trace.last < QUIET_S:
                await asyncio.sleep(QUIET_S / 5)  # polls for quiet: what it left behind runs meanwhile
        finally:
            trace.open = False
            sys.settrace(None)
            threading.settrace(None)
    response.raise_for_status()
    files = sorted(trace.lines)
    total = sum(size(f) for f in files)
    ran = sum(len(lines) for lines in trace.lines.values())
    out = [f"{name}: {len(files)} files, {total:,} lines in them, {ran:,} lines run"]
    if show_files:
        for f in files:
            out.append(f"  {Path(f).relative_to(ROOT)}: {size(f)} lines, {len(trace.lines[f])} run")
    return "\n".join(out)


async def serve_and_measure(env: dict[str, str], api_key: str, show_files: bool) -> list[str]:
    import uvicorn

    from gateway.server.app import create_app
    from gateway.server.settings import GatewaySettings
    from gateway.stack.process import free_port

    port = free_port()
    os.environ.update({**env, "HOST": "127.0.0.1", "PORT": str(port), "LOG_LEVEL": "WARNING"})
    settings = GatewaySettings()
    config = uvicorn.Config(
        marked(create_app(settings)),
        host="127.0.0.1",
        port=port,
        http="gateway.server.serve:LimitedHttpProtocol",
        loop="none",  # this loop: the pure-Python one
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    serving = asyncio.create_task(server.serve())
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url) as client:
        while not server.started or (await client.get("/readyz")).status_code != 200:
            if serving.done():
                serving.result()
            await asyncio.sleep(0.2)  # polls readiness
    try:
        return [await measure(url, api_key, name, show_files) for name in REQUESTS]
    finally:
        server.should_exit = True
        await serving


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", action="store_true", help="list the files, with their lines and the lines run")
    args = parser.parse_args()

    from gateway.stack.settings import StackSettings
    from gateway.stack.stack import LocalStack
    from gateway.stack.weights import build_tiny_clip, build_tiny_gpt2

    with tempfile.TemporaryDirectory(prefix="footprint-") as tmp:
        root = Path(tmp)
        settings = StackSettings.on_free_ports(
            data_dir=root / "stack",
            llm_model=str(build_tiny_gpt2(root / "tiny-gpt2")),
            clip_model=str(build_tiny_clip(root / "tiny-clip")),
            allow_downloads=False,
            start_gateway=False,
            startup_timeout_s=1800,  # a loaded machine starts Triton slowly
        )
        stack = LocalStack(settings, log=lambda line: print(line, file=sys.stderr))
        stack.start()
        try:
            lines = asyncio.run(serve_and_measure(stack.service_env, stack.api_key or "", args.files))
        finally:
            stack.stop()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
