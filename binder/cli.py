"""`binder run`: the binder worker process (settings from the environment)."""

from __future__ import annotations

import typer
from pydantic import ValidationError

app = typer.Typer(help="Binder: results to MongoDB and FAISS, webhooks.", no_args_is_help=True)


def settings_problem(exc: ValidationError) -> str:
    """One line naming each invalid setting and what is wrong with it. Built from the
    error messages alone: pydantic's own text quotes the value, which may be a secret."""
    problems = []
    for error in exc.errors(include_input=False, include_url=False):
        name = "_".join(str(part) for part in error["loc"]).upper()
        message = str(error["msg"]).removeprefix("Value error, ")
        problems.append(f"{name}: {message}" if name else message)
    return " ".join("; ".join(problems).split())


@app.command()
def run() -> None:
    """Run the binder: result worker, index follower, webhook sender, internal API."""
    import uvicorn

    from binder.settings import BinderSettings

    try:
        settings = BinderSettings()
    except ValidationError as exc:
        typer.echo(f"binder: invalid settings: {settings_problem(exc)}", err=True)
        raise typer.Exit(2) from None
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
