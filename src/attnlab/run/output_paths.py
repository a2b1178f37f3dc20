"""Output paths checked before any work: a run of minutes must not end with "cannot write there".

Every command that writes (``train --out``, ``demo --out``, ``attention --out``, ``word2vec --out``,
``import bert --out``, ``bench --save``, ``heads ... --out``) calls :func:`check_output_path` first,
before it loads a model, reads a corpus or trains. The check touches nothing on disk: it creates no
folder and no file, so a refused command leaves no trace.

What is checked (each failure is one :class:`~attnlab.errors.UsageError` naming the flag and path):

* every name in the path fits the file system (``NAME_MAX``, usually 255 bytes) and the whole path
  fits ``PATH_MAX``: a 300-character name is an error, not an ``OSError`` traceback;
* no file stands where a folder is needed (the output itself or a folder above it), and no folder
  stands where a file is to be written;
* a run directory (``kind="run"``) is new or empty, unless ``overwrite``;
* the folder that will receive the output, or the nearest existing folder above it, is writable.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from attnlab.errors import UsageError

__all__ = ["OutputKind", "check_output_path", "name_max", "path_max"]

OutputKind = Literal["file", "folder", "run"]

_KINDS = ("file", "folder", "run")
_DEFAULT_NAME_MAX = 255
_DEFAULT_PATH_MAX = 4096


def name_max(folder: Path) -> int:
    """The longest file name (in bytes) the file system of ``folder`` allows (``NAME_MAX``)."""
    return _pathconf(folder, "PC_NAME_MAX", _DEFAULT_NAME_MAX)


def path_max(folder: Path) -> int:
    """The longest path (in bytes) the file system of ``folder`` allows (``PATH_MAX``)."""
    return _pathconf(folder, "PC_PATH_MAX", _DEFAULT_PATH_MAX)


def _pathconf(folder: Path, name: str, default: int) -> int:
    try:
        value = os.pathconf(folder, name)
    except (AttributeError, ValueError, OSError):
        return default
    return value if value > 0 else default


def check_output_path(
    path: str | os.PathLike[str], *, kind: OutputKind = "file", flag: str = "--out", overwrite: bool = False
) -> Path:
    """Check, without writing anything, that ``path`` can receive an output of ``kind``.

    Args:
        path: where the command will write.
        kind: ``file`` (one file, replaced if it exists), ``folder`` (a folder that may exist and hold
            other files) or ``run`` (a run directory: new or empty).
        flag: the option the path came from, for the message (``--out``, ``--save``).
        overwrite: a ``run`` may be an existing, non-empty folder (``--force``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        UsageError: naming ``flag``, the path and what is wrong.
    """
    if kind not in _KINDS:
        raise ValueError(f"kind: unknown {kind!r}; allowed: {', '.join(_KINDS)}")
    path = Path(path)
    where = f"{flag} {_shown(path)}"
    if str(path) in ("", "."):
        if kind == "file":
            raise UsageError(f"{flag}: give a file name")
    existing = _nearest_existing(path)
    _check_lengths(path, existing, where)
    if existing != Path(os.path.abspath(path)) and not existing.is_dir():  # a file where a folder must be
        raise UsageError(f"{where}: {_shown(existing)} is a file, not a folder; choose another {flag}")
    if path.exists():
        _check_existing(path, kind, where, flag, overwrite)
        return path
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: cannot write into {_shown(existing)} (permission denied); choose another {flag}")
    return path


def _check_existing(path: Path, kind: OutputKind, where: str, flag: str, overwrite: bool) -> None:
    if kind == "file":
        if path.is_dir():
            raise UsageError(f"{where} is a folder; give a file name")
        if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
            raise UsageError(f"{where}: cannot replace this file (permission denied); choose another {flag}")
        return
    if not path.is_dir():
        raise UsageError(f"{where} is a file; give a folder{' for the run' if kind == 'run' else ''}")
    if kind == "run" and not overwrite and any(path.iterdir()):
        raise UsageError(f"{where}: run directory already exists and is not empty; choose another {flag}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{where}: cannot write into this folder (permission denied); choose another {flag}")


def _nearest_existing(path: Path) -> Path:
    """``path`` itself if it exists, else the nearest folder above it that does (or the working folder)."""
    absolute = Path(os.path.abspath(path))
    for candidate in (absolute, *absolute.parents):
        try:
            if candidate.exists() or candidate.is_symlink():
                return candidate
        except OSError:  # a name too long to even look up
            continue
    return Path.cwd()


def _check_lengths(path: Path, existing: Path, where: str) -> None:
    folder = existing if existing.is_dir() else existing.parent
    longest = name_max(folder)
    for part in Path(os.path.abspath(path)).parts:
        size = len(os.fsencode(part))
        if size > longest:
            raise UsageError(
                f"{where}: the name {_shown(Path(part), 40)!s} is {size} bytes long, more than the file system "
                f"allows ({longest}); choose a shorter name"
            )
    total = len(os.fsencode(os.path.abspath(path)))
    if total > path_max(folder):
        raise UsageError(
            f"{where}: the path is {total} bytes long, more than the file system allows "
            f"({path_max(folder)}); choose a shorter path"
        )


def _shown(path: Path, limit: int = 80) -> str:
    """The path for a one-line message, shortened in the middle when it is very long."""
    text = str(path)
    return text if len(text) <= limit else f"{text[: limit // 2]}...{text[-(limit // 2) + 3 :]}"
