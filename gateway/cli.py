"""The `gateway` command: run the local stack (`up`) or the server (`serve`), manage
production model repositories (`model-repo`), and talk to a gateway (infer, result,
watch, cancel, search). Server and stack code is imported only when its command runs,
so a client-only install runs the rest."""

from __future__ import annotations

import sys

from gateway.stack import signals

if sys.argv[1:2] == ["up"]:
    # `gateway up` handles Ctrl-C and SIGTERM from here on, before the imports below,
    # whatever it inherited (a script's background job has SIGINT ignored).
    signals.install()

from typing import Annotated

import typer

from gateway.client.cli import app as client_app
from gateway.deploy.cli import app as model_repo_app
from gateway.server.tenants.cli import app as keys_app
from gateway.stack.cli import up

app = typer.Typer(help="Async serving gateway for NVIDIA Triton Inference Server.", no_args_is_help=True)
app.registered_commands.extend(client_app.registered_commands)
app.command()(up)
app.add_typer(model_repo_app, name="model-repo", help="Production model repositories, engines, compose.")
app.add_typer(keys_app, name="keys", help="API keys: create, list, revoke.")


@app.command()
def serve(
    workers: Annotated[
        int, typer.Option(min=1, envvar="GATEWAY_WORKERS", help="Processes sharing the port, each with its dispatchers")
    ] = 1,
) -> None:
    """Run the gateway HTTP server (settings from the environment)."""
    try:
        from gateway.server.serve import serve as run_server
        from gateway.server.settings import GatewaySettings
    except ImportError as exc:
        missing = f"error: the server is not installed ({exc.name}): pip install 'triton-gateway[server]'"
        raise SystemExit(missing) from None
    run_server(GatewaySettings(), workers=workers)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
