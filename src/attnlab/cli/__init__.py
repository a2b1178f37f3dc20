"""Command line: the only place that parses argv, prints for people and exits.

Every error reaches the terminal as one ``error: ...`` line on stderr, never a traceback:

* library errors (:class:`attnlab.errors.AttnlabError`) with the error's exit code (2 bad usage or
  input, 3 corrupt or unreadable data, 4 not enough resources, 5 a diverged run);
* click's usage errors (unknown option or command, missing argument, bad value) with exit code 2;
* anything else through :func:`last_resort`: a file the system refused (``OSError``) or too deep
  nesting (exit 2), memory that ran out (exit 4), text that is not UTF-8 (exit 3), or an internal
  error (exit 1) naming the exception's type. ``ATTNLAB_TRACEBACK=1`` in the environment re-raises
  instead, with the traceback.

Each command group lives in its own module and registers itself on :data:`attnlab.cli.app.app`
when imported below. A command module imports at its top only what needs no torch (typer,
:mod:`attnlab.errors`, :mod:`attnlab.cli.choices`, ...); anything that imports torch is imported inside
the command that uses it, so that ``--help``, shell completion and ``attnlab tokenize`` answer at once
(``tests/unit/test_cli_imports.py`` checks it).
"""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Sequence

import typer

try:  # typer >= 0.24 vendors click; older ones use the click package
    from typer._click.exceptions import ClickException, MissingParameter, NoArgsIsHelpError
    from typer.exceptions import Abort
except ImportError:  # pragma: no cover - depends on the installed typer
    from click.exceptions import Abort, ClickException, MissingParameter, NoArgsIsHelpError

# Command modules register themselves on `app` when imported.
from attnlab.cli import attention as _attention  # noqa: F401,E402
from attnlab.cli import attribute as _attribute  # noqa: F401,E402
from attnlab.cli import bench as _bench  # noqa: F401,E402
from attnlab.cli import demo as _demo  # noqa: F401,E402
from attnlab.cli import encode as _encode  # noqa: F401,E402
from attnlab.cli import evaluate as _evaluate  # noqa: F401,E402
from attnlab.cli import generate as _generate  # noqa: F401,E402
from attnlab.cli import heads as _heads  # noqa: F401,E402
from attnlab.cli import imports as _imports  # noqa: F401,E402
from attnlab.cli import info as _info  # noqa: F401,E402
from attnlab.cli import patch as _patch  # noqa: F401,E402
from attnlab.cli import sites as _sites  # noqa: F401,E402
from attnlab.cli import sweep as _sweep  # noqa: F401,E402
from attnlab.cli import tokenize as _tokenize  # noqa: F401,E402
from attnlab.cli import train as _train  # noqa: F401,E402
from attnlab.cli import verify as _verify  # noqa: F401,E402
from attnlab.cli import view as _view  # noqa: F401,E402
from attnlab.cli import word2vec as _word2vec  # noqa: F401,E402
from attnlab.cli.app import CommandLine, app
from attnlab.cli.processes import quiet_error
from attnlab.errors import EXIT_CORRUPT, EXIT_INTERNAL, EXIT_RESOURCES, EXIT_USAGE, AttnlabError, AttnlabWarning

EXIT_INTERRUPTED = 130
"""The shell's code for a process stopped by Ctrl-C (128 + SIGINT)."""

TRACEBACK_ENV = "ATTNLAB_TRACEBACK"
"""Set to 1 to let an unexpected exception raise with its traceback instead of one line."""

LONGEST_QUOTED = 1000
"""Characters of a command-line value an error line quotes in full (a long path included); longer ones,
such as a 5,000-digit number, are quoted by their start and length."""

_ALLOCATOR_MESSAGES = ("can't allocate memory", "defaultcpuallocator", "out of memory")
"""Parts of the RuntimeError text torch's allocators raise when memory runs out."""


def _show_warning(message, category, filename, lineno, file=None, line=None, *, _default=warnings.showwarning):  # noqa: ANN001
    """Print attnlab's own warnings as one ``warning: ...`` line; others as Python would."""
    if issubclass(category, AttnlabWarning):
        typer.echo(f"warning: {one_line(str(message))}", err=True)
    else:
        _default(message, category, filename, lineno, file, line)


def one_line(message: str) -> str:
    """``message`` with its line breaks and runs of spaces folded into single spaces."""
    return " ".join(message.split())


def usage_message(error: ClickException, argv: Sequence[str] = ()) -> str:
    """Click's message for a usage error, after the command it concerns (``attnlab eval: ...``).

    Args:
        error: a click exception (no such option or command, missing or bad parameter, ...).
        argv: the command line, to quote the value an option refused (``--port 'http'``).

    Returns:
        One line, without click's usage block or "Try --help" hint.
    """
    message = one_line(error.format_message()).replace("Value error, ", "")  # typer's pydantic prefix
    value = _given_value(argv, getattr(getattr(error, "param", None), "opts", None) or ())
    if value is not None and not isinstance(error, MissingParameter):
        message = message.replace(": ", f": {value!r}: ", 1) if ": " in message else f"{message} ({value!r})"
    message = shorten_values(message, argv)
    context = getattr(error, "ctx", None)
    return f"{context.command_path}: {message}" if context is not None else message


def shorten_values(message: str, argv: Sequence[str]) -> str:
    """``message`` with each command-line value longer than :data:`LONGEST_QUOTED` characters
    quoted by its start and length: a 5,000-digit number or a pasted book is not echoed in full."""
    for arg in sorted(argv, key=len, reverse=True):
        if len(arg) > LONGEST_QUOTED:
            for part in {arg, arg.partition("=")[2], arg.partition(":")[2], arg.partition("-")[2]}:
                if len(part) > LONGEST_QUOTED:
                    message = message.replace(part, f"{part[:20]}... ({len(part):,} characters)")
    return message


def _given_value(argv: Sequence[str], options: Sequence[str]) -> str | None:
    """The last value ``argv`` gives an option named ``options`` (``--port 80`` or ``--port=80``)."""
    value = None
    for index, arg in enumerate(argv):
        name, equals, attached = arg.partition("=")
        if name in options and name.startswith("-"):
            if equals:
                value = attached
            elif index + 1 < len(argv):
                value = argv[index + 1]
    return value


def last_resort(error: BaseException) -> tuple[str, int]:
    """The one-line message and exit code for an exception no attnlab code turned into an error.

    Args:
        error: the exception that reached :func:`main`.

    Returns:
        ``(message, exit code)``: a file the system refused (``OSError``: the file and the reason)
        or nesting too deep for Python give exit code 2; memory that ran out exit code 4; bytes that are not
        UTF-8 give exit code 3 (damaged data); anything else is an internal error (exit code 1)
        that names the exception's type and how to see the traceback.
    """
    if isinstance(error, OSError):
        return _os_message(error), EXIT_USAGE
    if isinstance(error, MemoryError) or (
        isinstance(error, RuntimeError) and any(part in str(error).lower() for part in _ALLOCATOR_MESSAGES)
    ):
        asked = re.search(r"(?:tried|unable) to allocate (\d+(?:\.\d+)? ?\w+)", str(error), re.IGNORECASE)
        detail = f" (asked for {asked.group(1)})" if asked else ""
        return f"out of memory{detail}; use a smaller model, batch, input or --dim", EXIT_RESOURCES
    if isinstance(error, RecursionError):
        return "input nested too deeply to read (beyond Python's recursion limit)", EXIT_USAGE
    if isinstance(error, UnicodeDecodeError):
        return (
            f"a file is damaged or not UTF-8 text: byte {error.object[error.start : error.start + 1]!r} "
            f"at offset {error.start} cannot be decoded"
        ), EXIT_CORRUPT
    detail = one_line(str(error))[:500]
    return (
        f"internal error: {type(error).__name__}{': ' + detail if detail else ''} "
        f"(set {TRACEBACK_ENV}=1 to see the traceback)"
    ), EXIT_INTERNAL


def _os_message(error: OSError) -> str:
    """``<file>: <reason>`` for an OSError (``a -> b: <reason>`` when it names two files)."""
    reason = error.strerror or one_line(str(error)) or type(error).__name__
    if error.filename is None:
        return reason
    names = os.fsdecode(error.filename)
    if getattr(error, "filename2", None) is not None:
        names += f" -> {os.fsdecode(error.filename2)}"
    return f"{names}: {reason}"


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {one_line(message)}", err=True)
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``attnlab`` console script and ``python -m attnlab``.

    Runs the command in ``argv`` (default: ``sys.argv[1:]``) and always ends with ``SystemExit``:
    0 on success, or the code of the error it printed as one ``error: ...`` line.
    """
    warnings.showwarning = _show_warning
    args = sys.argv[1:] if argv is None else list(argv)
    try:  # the command line travels to the commands that run it again on N processes (--nproc)
        code = app(args=args, prog_name="attnlab", standalone_mode=False, obj=CommandLine(tuple(args)))
    except NoArgsIsHelpError as error:  # `attnlab` or `attnlab heads` alone: the help (rich printed it already)
        if error.format_message().strip():
            typer.echo(error.format_message(), err=True)
        sys.exit(error.exit_code)
    except ClickException as error:
        _fail(usage_message(error, args), error.exit_code)
    except AttnlabError as error:
        if quiet_error(error):  # one of N processes: the first reports what all of them met
            sys.exit(error.exit_code)
        _fail(shorten_values(str(error), args), error.exit_code)
    except (KeyboardInterrupt, Abort):
        typer.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except Exception as error:  # noqa: BLE001 - the last resort: one line, never a traceback
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        _fail(*last_resort(error))
    # Without standalone mode click returns a command's return value, or the code of an Exit.
    code = code if isinstance(code, int) else 0
    if code == EXIT_INTERRUPTED:  # typer turns Ctrl-C into Exit(130)
        typer.echo("interrupted", err=True)
    sys.exit(code)
