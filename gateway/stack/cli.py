"""`gateway up`: start the whole local stack in the foreground; Ctrl-C stops it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

app = typer.Typer()


@app.command()
def up(
    data_dir: Annotated[Path | None, typer.Option(help="Data and logs (env STACK_DATA_DIR, default .stack)")] = None,
    triton_http_port: Annotated[int | None, typer.Option(help="default 8000")] = None,
    triton_grpc_port: Annotated[int | None, typer.Option(help="default 8001")] = None,
    triton_metrics_port: Annotated[int | None, typer.Option(help="default 8002")] = None,
    redis_port: Annotated[int | None, typer.Option(help="default 6379")] = None,
    mongo_port: Annotated[int | None, typer.Option(help="default 27017 (ignored when MONGO_URL is set)")] = None,
    gateway_port: Annotated[int | None, typer.Option(help="default 8080")] = None,
    binder_port: Annotated[int | None, typer.Option(help="default 8090")] = None,
    llm_model: Annotated[
        str | None, typer.Option(help="smollm2-135m-instruct (default, packaged), an HF id or a directory")
    ] = None,
    clip_model: Annotated[
        str | None, typer.Option(help="HF id or directory (default openai/clip-vit-base-patch32)")
    ] = None,
    device: Annotated[
        str | None, typer.Option(help="where the models run: auto (default: cuda when torch sees a GPU), cpu, cuda")
    ] = None,
) -> None:
    """Start Triton, Redis, the MongoDB-wire server, the binder and the gateway; Ctrl-C stops them all."""
    overrides = {name: value for name, value in locals().items() if value is not None}
    from gateway.stack import signals

    # Handlers first (gateway/cli.py installs them before its imports; this covers other
    # entries), whatever was inherited: a script's background job has SIGINT ignored.
    signals.install()
    os.umask(0o077)  # data directory 0700, files 0600, for the launcher and its children
    stack = None
    code = 0
    try:
        signals.arm()  # from here a stop request aborts whatever start-up step is running
        try:
            from gateway.stack.settings import StackSettings
            from gateway.stack.stack import LocalStack, start_or_explain
        except ImportError as exc:
            missing = f"error: the local stack is not installed ({exc.name}): pip install 'triton-gateway[local]'"
            raise SystemExit(missing) from None

        settings = StackSettings(**overrides)
        stack = LocalStack(settings)
        started = time.monotonic()
        typer.echo(f"starting the local stack in {settings.data_dir.resolve()} (logs in logs/)")
        start_or_explain(stack)
        s = settings
        typer.echo(f"all healthy in {time.monotonic() - started:.1f}s")
        typer.echo(f"   gateway   http://{s.host}:{s.gateway_port}   (API docs /docs)")
        typer.echo(f"   triton    http://{s.host}:{s.triton_http_port}  grpc {s.host}:{s.triton_grpc_port}")
        typer.echo(f"   redis     redis://{s.host}:{s.redis_port}/0")
        typer.echo(f"   mongodb   {stack.mongo_url}")
        if stack.api_key_created:
            typer.echo(f"   API key   {stack.api_key}")
            typer.echo(f"             (operator, tenant 'local', saved in {stack.api_key_file} for the CLI and SDK)")
        else:
            typer.echo(f"   API key   in {stack.api_key_file} (the CLI and the client SDK read it from there)")
        typer.echo("press Ctrl-C to stop")
        code = stack.supervise()
    except signals.StopRequested as stop:
        typer.echo(f"{stop} received")
    finally:
        with signals.shielded():
            if stack is not None:
                stack.shutdown()
        signals.disarm()
    raise typer.Exit(code)
