"""``attnlab view``: the local attention viewer (see :mod:`attnlab.viewer` and its ``API.md``)."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    device_map_option,
    device_option,
    dtype_option,
    max_memory_option,
    offload_folder_option,
    placed,
    revision_option,
    verify_option,
)


@app.command()
def view(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    host: str = typer.Option(
        "127.0.0.1",
        "--host",
        help=(
            "Address to listen on (default: this machine only). Any other than a loopback address needs --allow-host."
        ),
    ),
    allow_host: list[str] = typer.Option(
        None,
        "--allow-host",
        metavar="NAME",
        help=(
            "A host name (or IP address) the viewer answers to besides localhost, 127.0.0.1 and [::1]; "
            "repeatable. Requests with any other Host header get status 400."
        ),
    ),
    port: int = typer.Option(8765, "--port", min=0, max=65535, help="Port to listen on (0 = any free port)."),
    importance: Path = typer.Option(
        None, "--importance", help="CSV from `attnlab heads importance`, to colour heads by importance."
    ),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
) -> None:
    """Start the attention viewer: type an input, see every head's attention, switch heads off live."""
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.head_ids import head_ids
    from attnlab.pretrained.sources import open_model
    from attnlab.viewer.importance import read_importance
    from attnlab.viewer.serve import LOOPBACK_HOSTS, allowed_hosts, is_loopback, listen, make_server, url_of
    from attnlab.viewer.server import create_app

    names = allowed_hosts(host, allow_host or [], host_flag="--host", names_flag="--allow-host")
    loaded = open_model(
        run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
    )
    scores = None if importance is None else read_importance(importance, frozenset(head_ids(loaded.model)))
    app_ = create_app(loaded, importance=scores, allowed_hosts=names, internal_error=_internal_error)
    sock = listen(host, port, host_flag="--host")
    if not is_loopback(host):
        typer.echo(
            f"warning: listening on {host}: anyone who can reach this machine as "
            f"{', '.join(names[len(LOOPBACK_HOSTS) :]) or 'localhost'} can use the viewer",
            err=True,
        )
    typer.echo(f"attention viewer for {run}: {url_of(sock)}  (Ctrl-C to stop)")
    make_server(app_).run(sockets=[sock])


def _internal_error(error: Exception) -> str | None:
    """The CLI's one line for an exception the viewer did not expect (a bug), or None to let it
    raise with its traceback (``ATTNLAB_TRACEBACK=1``)."""
    from attnlab.cli import TRACEBACK_ENV, last_resort  # lazy: attnlab.cli imports this module as it loads

    if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
        return None
    return last_resort(error)[0]
