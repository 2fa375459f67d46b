"""`k3rl sandbox build|doctor|gc` (mounted by k3rl.cli as the `sandbox` sub-command)."""

from __future__ import annotations

import logging

import typer

from . import cli_build, cli_doctor, cli_gc

app = typer.Typer(help="Sandboxes: build the image, check the host, remove leftovers.", no_args_is_help=True)


@app.command()
def build(
    force: bool = typer.Option(False, "--force", help="rebuild even when the recipe is unchanged"),
) -> None:
    """Build k3rl-sandbox:<version> offline (debootstrap + docker import) if its recipe changed."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cli_build(force=force)


@app.command()
def doctor() -> None:
    """Say which sandbox backends work here and what to install for the others."""
    if not cli_doctor():
        raise typer.Exit(code=1)


@app.command()
def gc(
    job: str | None = typer.Option(None, "--job", help="remove every sandbox of this job"),  # noqa: UP007
    all: bool = typer.Option(False, "--all", help="remove every k3rl sandbox, live owners included"),
) -> None:
    """Remove sandboxes whose owning process is gone (or all of --job, or --all)."""
    cli_gc(job=job, all=all)


if __name__ == "__main__":
    app()
