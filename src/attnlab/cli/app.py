"""The Typer application that every command module registers on.

Kept apart from ``cli/__init__.py`` so that command modules can import ``app`` without a cycle.
"""

from __future__ import annotations

import typer

from attnlab import __version__

app = typer.Typer(
    name="attnlab",
    help="attnlab: an open laboratory for attention and Transformers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"attnlab {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """attnlab: build, train, decode, inspect and ablate attention models."""
