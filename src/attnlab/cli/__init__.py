"""Command line: the only place that parses argv, prints for people and exits.

Library errors (:class:`attnlab.errors.AttnlabError`) become a one-line ``error: ...`` on stderr
and the error's exit code (2 bad usage or input, 3 corrupt or unreadable data, 4 a diverged run),
never a traceback. Each command group lives in its own module and registers
itself on :data:`attnlab.cli.app.app` when imported below.
"""

from __future__ import annotations

import sys
import warnings

import typer

from attnlab.cli.app import app
from attnlab.errors import AttnlabError, AttnlabWarning

# Command modules register themselves on `app` when imported.
from attnlab.cli import attention as _attention  # noqa: F401,E402
from attnlab.cli import bench as _bench  # noqa: F401,E402
from attnlab.cli import demo as _demo  # noqa: F401,E402
from attnlab.cli import encode as _encode  # noqa: F401,E402
from attnlab.cli import evaluate as _evaluate  # noqa: F401,E402
from attnlab.cli import generate as _generate  # noqa: F401,E402
from attnlab.cli import heads as _heads  # noqa: F401,E402
from attnlab.cli import imports as _imports  # noqa: F401,E402
from attnlab.cli import info as _info  # noqa: F401,E402
from attnlab.cli import train as _train  # noqa: F401,E402
from attnlab.cli import tokenize as _tokenize  # noqa: F401,E402
from attnlab.cli import verify as _verify  # noqa: F401,E402
from attnlab.cli import view as _view  # noqa: F401,E402
from attnlab.cli import word2vec as _word2vec  # noqa: F401,E402

def _show_warning(message, category, filename, lineno, file=None, line=None, *, _default=warnings.showwarning):  # noqa: ANN001
    """Print attnlab's own warnings as one ``warning: ...`` line; others as Python would."""
    if issubclass(category, AttnlabWarning):
        typer.echo(f"warning: {message}", err=True)
    else:
        _default(message, category, filename, lineno, file, line)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``attnlab`` console script and ``python -m attnlab``."""
    warnings.showwarning = _show_warning
    try:
        app(args=argv, standalone_mode=True)
    except AttnlabError as error:
        typer.echo(f"error: {error}", err=True)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        typer.echo("interrupted", err=True)
        sys.exit(130)
