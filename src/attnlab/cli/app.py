"""The Typer application that every command module registers on.

Kept apart from ``cli/__init__.py`` so that command modules can import ``app`` without a cycle.
"""

from __future__ import annotations

import typer

from attnlab import __version__

EXIT_CODES = (
    "Exit codes: 0 success; 1 internal error (set ATTNLAB_TRACEBACK=1 to see the traceback); "
    "2 bad usage or input; 3 corrupt or unreadable data; 4 a diverged run (NaN or Inf loss). "
    "Every error is one 'error: ...' line on stderr."
)
"""The exit codes of every command (:mod:`attnlab.errors`), shown under ``attnlab --help``."""

app = typer.Typer(
    name="attnlab",
    help="attnlab: an open laboratory for attention and Transformers.",
    epilog=EXIT_CODES,
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
