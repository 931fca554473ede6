"""`gateway up`: start the whole local stack in the foreground; Ctrl-C stops it."""

from __future__ import annotations

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
    llm_model: Annotated[str | None, typer.Option(help="HF id or directory (default gpt2-medium)")] = None,
    clip_model: Annotated[
        str | None, typer.Option(help="HF id or directory (default openai/clip-vit-base-patch32)")
    ] = None,
) -> None:
    """Start Triton, Redis, the MongoDB-wire server, the binder and the gateway; Ctrl-C stops them all."""
    overrides = {name: value for name, value in locals().items() if value is not None}
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
    typer.echo("press Ctrl-C to stop")
    raise typer.Exit(stack.run_until_signal()) from None
