"""`binder run`: the binder worker process (settings from the environment)."""

from __future__ import annotations

import typer

app = typer.Typer(help="Binder: results to MongoDB and FAISS, webhooks.", no_args_is_help=True)


@app.command()
def run() -> None:
    """Run the binder: result worker, index follower, webhook sender, internal API."""
    import uvicorn

    from binder.settings import BinderSettings

    settings = BinderSettings()
    uvicorn.run(
        "binder.app:create_app",
        factory=True,
        host=settings.binder_host,
        port=settings.binder_port,
        log_level=settings.log_level.lower(),
        access_log=False,
    )


@app.command()
def version() -> None:
    typer.echo("binder 0.1.0")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
