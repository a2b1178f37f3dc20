"""Options that many commands share, defined once: ``--device``, ``--dtype``, ``--revision``,
``--verify``, ``--json`` and ``--progress``.

* ``--device auto|cpu|cuda|cuda:N`` on every command that runs a model; click checks the name and
  resolves it (:func:`attnlab.devices.resolve_device`) before the command starts, so a bad name or a
  GPU that is not there is click's one-line usage error naming ``--device`` (exit code 2).
* ``--json``: the command prints one JSON object on stdout and nothing else; progress bars, notes
  and warnings go to stderr (:func:`print_json`).
* ``--progress/--no-progress``: progress bars, always on stderr; on unless ``--no-progress``.

No torch at import: the device is resolved inside the option's callback, which resolves only
when the command runs (``--help`` exits before it; shell completion leaves the name unresolved).
"""

from __future__ import annotations

import json
from typing import Any

import typer

DEVICE_METAVAR = "[auto|cpu|cuda|cuda:N]"
DEVICE_HELP = "Where to run the model: auto (the GPU when there is one, else the CPU), cpu, cuda or cuda:N."
PROGRESS_HELP = "Show progress bars (on stderr)."
JSON_HELP = "Print one JSON object on stdout (progress and notes go to stderr)."


def _resolve_device(ctx: typer.Context, value: str | None) -> str | None:
    """The ``--device`` callback: the resolved name (``auto`` -> ``cpu`` or ``cuda``), None if not given.

    Shell completion parses the command line too (resilient parsing): the name is then left as given.
    """
    if value is None or ctx.resilient_parsing:
        return value
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.devices import resolve_device

    try:
        return str(resolve_device(value))
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None


def device_option(default: str | None = "auto", help: str = DEVICE_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--device`` option; its value reaches the command resolved: ``cpu``, ``cuda`` or ``cuda:N``."""
    return typer.Option(default, "--device", metavar=DEVICE_METAVAR, callback=_resolve_device, help=help)


DTYPES = ("float32", "bfloat16", "float16")
SOURCE_HELP = (
    "The model: a run directory, a Hugging Face model folder, the NAME or ORG/NAME of a model in the local "
    "Hugging Face cache (never downloaded), or a GGUF file."
)


def _check_dtype(ctx: typer.Context, value: str | None) -> str | None:
    if value is None or ctx.resilient_parsing or value in DTYPES:
        return value
    raise typer.BadParameter(f"unknown {value!r}; allowed: {', '.join(DTYPES)}")


def dtype_option() -> Any:
    """The ``--dtype`` option: the model's weights and computation in this dtype (default: as stored)."""
    return typer.Option(
        None,
        "--dtype",
        metavar="[float32|bfloat16|float16]",
        callback=_check_dtype,
        help="Run the model in this dtype (default: as its weights are stored; a run's are float32).",
    )


def revision_option() -> Any:
    """The ``--revision`` option: a snapshot of a model in the Hugging Face cache."""
    return typer.Option(
        None, "--revision", help="For a model in the Hugging Face cache: the snapshot (a commit or a ref such as main)."
    )


def verify_option() -> Any:
    """The ``--verify/--no-verify`` option: check source files that have a known SHA-256 (a named
    package's, a Hugging Face cache blob's: :mod:`attnlab.pretrained.provenance`) when they are opened."""
    return typer.Option(
        True,
        "--verify/--no-verify",
        help="Check files of named packages and Hugging Face cache blobs against their SHA-256 (hashes are cached).",
    )


def progress_option(help: str = PROGRESS_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--progress/--no-progress`` option (on by default; bars on stderr)."""
    return typer.Option(True, "--progress/--no-progress", help=help)


def json_option(help: str = JSON_HELP) -> Any:  # noqa: A002 - typer's name
    """The ``--json`` flag."""
    return typer.Option(False, "--json", help=help)


def print_json(result: Any) -> None:
    """Print ``result`` as one line of JSON on stdout (keys sorted; paths and other objects as strings)."""
    typer.echo(json.dumps(result, sort_keys=True, default=str))
