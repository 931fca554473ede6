"""The floor under the gateway's CPU a request: what one Python process on this machine
spends a request with no gateway logic at all, side by side with the gateway in one run.

Three servers, each one uvicorn process on uvloop and httptools as the gateway runs, the
same closed loop of clients against each in alternating slices:
  bare     reads the POST's JSON body, answers a fixed JSON body (the HTTP edge alone);
  proxy    reads the body, makes one `tritonclient.grpc.aio` infer of the model for it
           and answers the vector as JSON (the thinnest HTTP-to-Triton front);
  gateway  the local stack's gateway, `POST /infer` with `Prefer: wait` (durable in Redis,
           fenced, stored by the binder, fair across tenants, ...).
Direct Triton gRPC from the client runs in the same rounds, for the ratio. Each server's
CPU a request is the change of its process's utime + stime over its slices (bench/cpu.py).

With --also DIR, a second gateway from the checkout in DIR (a worktree of another commit,
with its own .venv or a link to this one) joins the same stack, Redis and Triton, and
takes its slices in the same rounds: a change and its base measured side by side.

Run:  .venv/bin/python -m bench.edge_floor
      .venv/bin/python -m bench.edge_floor --clients 32 --slice 5 --rounds 3 --model clip_text
      .venv/bin/python -m bench.edge_floor --servers gateway --also /tmp/wt-before --rounds 6
The servers are started here on free ports and stopped by their pids when it ends."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tritonclient.grpc.aio as triton_aio
from tritonclient.grpc import InferInput, InferRequestedOutput

from bench.cpu import ProcessCpu
from bench.gateway_bench import INPUTS, Gateways, Samples, closed_loop, direct_call, ratio, row, sync_call
from bench.stack import ROOT, local_stack
from gateway.server.models.registry import LOCAL_PROFILE
from gateway.stack.process import ManagedProcess, ServiceSpec, free_port
from gateway.stack.stack import LocalStack

# The text embedding models of the local profile, by name: their output tensor's name.
OUTPUTS = {spec.name: spec.output for spec in LOCAL_PROFILE if spec.kind == "embedding" and spec.input == "text"}


def create_app() -> Any:
    """The ASGI app of a floor server: FLOOR_MODE=bare or proxy (FLOOR_TRITON, FLOOR_MODEL)."""
    mode = os.environ["FLOOR_MODE"]
    model = os.environ.get("FLOOR_MODEL", "clip_text")
    output = OUTPUTS[model]
    triton: triton_aio.InferenceServerClient | None = None
    fixed = json.dumps({"status": "succeeded", "outputs": {output: [0.0] * 8}}).encode()

    async def read_body(receive: Any) -> bytes:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                return body

    async def answer(send: Any, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def app(scope: dict, receive: Any, send: Any) -> None:
        nonlocal triton
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            if triton is not None:
                await triton.close()
            await send({"type": "lifespan.shutdown.complete"})
            return
        request = json.loads(await read_body(receive))
        if mode == "bare":
            await answer(send, fixed)
            return
        if triton is None:
            triton = triton_aio.InferenceServerClient(os.environ["FLOOR_TRITON"])
        text = request["inputs"]["text"].encode()
        tensor = InferInput("text", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[text]], dtype=np.object_))
        result = await triton.infer(model, [tensor], outputs=[InferRequestedOutput(output)])
        vector = result.as_numpy(output).reshape(-1).astype(float).tolist()
        await answer(send, json.dumps({"status": "succeeded", "outputs": {output: vector}}).encode())

    return app


@contextmanager
def floor_server(mode: str, triton_url: str, model: str, logs: Path) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serving(
        ServiceSpec(
            name=f"floor-{mode}",
            argv=[sys.executable, "-m", "uvicorn", "bench.edge_floor:create_app", "--factory", "--port", str(port),
                  "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning"],
            log_file=logs / f"floor-{mode}.log",
            ports=[(port, f"the {mode} floor server")],
            env={"FLOOR_MODE": mode, "FLOOR_TRITON": triton_url, "FLOOR_MODEL": model},
            cwd=ROOT,
            ready=lambda: httpx.post(url, json={"inputs": {"text": "warm"}}, timeout=5).is_success,
        )
    ):  # fmt: skip
        yield url


@contextmanager
def other_gateway(checkout: Path, stack: LocalStack, logs: Path) -> Iterator[str]:
    """A gateway from another checkout, on the stack's servers, as the stack runs its own."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _serving(
        ServiceSpec(
            name="other-gateway",
            argv=[str(checkout / ".venv" / "bin" / "python"), "-m", "gateway.cli", "serve"],
            log_file=logs / "other-gateway.log",
            ports=[(port, "the other checkout's gateway")],
            env={**stack.service_env, "HOST": "127.0.0.1", "PORT": str(port), "PYTHONPATH": str(checkout)},
            cwd=checkout,
            ready=lambda: httpx.get(f"{url}/readyz", timeout=5).is_success,
        )
    ):
        yield url


@contextmanager
def _serving(spec: ServiceSpec) -> Iterator[None]:
    """The server runs for the block, then is stopped with its whole tree (by its pid)."""
    process = ManagedProcess(spec)
    process.start()
    try:
        process.wait_ready(time.monotonic() + 60)
        yield
    finally:
        process.stop()


async def measure(args: argparse.Namespace, triton_url: str, servers: dict[str, str], api_key: str) -> list[str]:
    triton = triton_aio.InferenceServerClient(triton_url)
    inputs = INPUTS[args.model]
    https = {name: Gateways([url], api_key) for name, url in servers.items()}
    calls = {"direct": direct_call(triton, args.model, inputs)}
    cpus = {"direct": lambda: 0.0}
    for name, http in https.items():
        calls[name] = sync_call(http, args.model, inputs)
        cpus[name] = http.cpu_seconds
    for call in calls.values():  # warm up every path
        await closed_loop(call, 8, 2, lambda: 0.0)
    totals = {name: Samples() for name in calls}
    for _ in range(args.rounds):
        for name, call in calls.items():
            totals[name].add(await closed_loop(call, args.clients, args.slice, cpus[name]))
    for http in https.values():
        await http.close()
    await triton.close()
    lines = [
        f"`{args.model}`, closed loop of {args.clients} clients, {args.rounds} x {args.slice:g} s a server:",
        "",
        row("server", "requests", "errors", "req/s", "p50 ms", "vs direct", "server CPU ms/req"),
        row(*["---"] * 7),
    ]
    for name, s in totals.items():
        cpu = s.cpu_ms() if name != "direct" else ""
        errors = sum(s.errors.values())
        lines.append(row(name, len(s.latencies), errors, f"{s.rate:.0f}", f"{s.pct(50):.2f}",
                         ratio(s.rate, totals["direct"].rate), cpu))  # fmt: skip
    for name, s in totals.items():
        lines += [f"  {name}: {error}" for error in list(s.errors)[:3]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="clip_text", choices=sorted(OUTPUTS))
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--slice", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--servers", default="bare,proxy,gateway", help="some of bare,proxy,gateway")
    parser.add_argument("--also", type=Path, help="a checkout whose gateway is measured beside this one's")
    args = parser.parse_args()
    with local_stack() as stack, ExitStack() as servers_up:
        assert stack.stack is not None
        logs = stack.stack.settings.data_dir / "logs"
        servers = {}
        for name in args.servers.split(","):
            servers[name] = (
                stack.gateway
                if name == "gateway"
                else servers_up.enter_context(floor_server(name, stack.triton_grpc, args.model, logs))
            )
        if args.also is not None:
            servers[f"gateway ({args.also})"] = servers_up.enter_context(
                other_gateway(args.also.resolve(), stack.stack, logs)
            )
        for url in servers.values():
            ProcessCpu.of_urls([url])  # each found by its port, or fail now
        print("\n".join(asyncio.run(measure(args, stack.triton_grpc, servers, stack.api_key))), flush=True)


if __name__ == "__main__":
    main()
