"""Reading the text files a person names: whole with a size cap, or line by line at any size.

Configs, ``--pairs``, word vectors, tokenizer files and the corpora a task holds in memory go
through :func:`read_capped`, so no input is read without a bound
(:data:`attnlab.limits.MAX_INPUT_BYTES`). A corpus streamed by a corpus run (``eval --texts``,
``heads importance | ablate | detect --texts``, :mod:`attnlab.analysis.corpus`) is read by
:func:`stream_lines` instead: line by line from a byte offset, so its size is unbounded and the
memory is bounded by the longest line allowed.

The files of a model folder (config.json, the weights, the tokenizer's files) are first looked at
with :func:`file_problem`, which only stats the path (and opens a regular file without waiting), so
that a missing file, a permission denied, a FIFO or device, a folder or a symlink loop in a file's
place is named for what it is before anything reads it: a FIFO is never read, ``/dev/zero`` never
mapped. :func:`describe_os_error` words an ``OSError`` the same way (the cause and the errno's
name, never Python's ``[Errno N]``).
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from attnlab.errors import AttnlabError, CheckpointError, DataError
from attnlab.limits import MAX_INPUT_BYTES

__all__ = [
    "read_capped",
    "Line",
    "stream_lines",
    "DamagedFileError",
    "FileProblem",
    "file_problem",
    "describe_os_error",
]

READ_BUFFER = 2**20
"""Bytes read from a streamed file at a time."""


def read_capped(path: str | os.PathLike[str], *, cap: int = MAX_INPUT_BYTES) -> bytes:
    """The bytes of the file ``path``, read up to ``cap`` bytes and refused past it.

    The one reader of the text files a person names (corpora, ``--texts``, ``--pairs``, configs,
    vectors, tokenizer files). It reads at most ``cap + 1`` bytes whatever the file is, so a device
    such as ``/dev/zero``, or a pipe that never ends, is refused after one bounded read. The open
    does not wait on a FIFO without a writer.

    Args:
        path: the file.
        cap: most bytes accepted (default :data:`MAX_INPUT_BYTES`).

    Returns:
        All the file's bytes.

    Raises:
        DataError: the file holds more than ``cap`` bytes; the message names it and the cap.
        OSError: the file cannot be opened or read (missing, a folder, no permission): each caller
            words that in its own terms.
    """
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.set_blocking(fd, True)  # a pipe or a device: read as a stream, within the cap
        data = handle.read(cap + 1)
    if len(data) > cap:
        raise DataError(
            f"{os.fspath(path)}: more than {cap:,} bytes, the cap on one text input "
            "(attnlab.limits.MAX_INPUT_BYTES); give a smaller file"
        )
    return data


@dataclass(frozen=True)
class Line:
    """A non-blank line of a streamed file: its 1-based ``number``, its ``text`` (without the line
    break) and ``end``, the byte offset where the next line starts (where a resumed read begins)."""

    number: int
    text: str
    end: int


def stream_lines(
    path: str | os.PathLike[str], *, max_line_chars: int, start: int = 0, number: int = 1
) -> Iterator[Line]:
    """The non-blank lines of the UTF-8 text file ``path``, read as they come, from byte ``start``.

    At most ``4 * max_line_chars + 2`` bytes (one line) are held at a time, whatever the file's
    size. Blank lines carry no text and are passed over (they are counted in the numbers); a final
    ``\\r`` (Windows line ends) is dropped.

    Args:
        path: a regular file (a corpus is read again from an offset when a run resumes).
        max_line_chars: a longer line is an error.
        start, number: the byte offset to start at and the number of the line that starts there.

    Raises:
        DataError: not a regular file, not readable, a line that is not UTF-8 or longer than
            ``max_line_chars``; the message names the file and the line.
    """
    limit = 4 * max_line_chars + 2  # a UTF-8 character takes at most 4 bytes; then \r\n
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block the open
    except OSError as error:
        raise DataError(f"{os.fspath(path)}: cannot read: {error.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataError(f"{os.fspath(path)}: not a regular file (a corpus is read by byte offsets)")
    with os.fdopen(fd, "rb", buffering=READ_BUFFER) as handle:
        handle.seek(start)
        offset = start
        while raw := handle.readline(limit):
            offset += len(raw)
            where = f"{os.fspath(path)}:{number}"
            if len(raw) == limit and not raw.endswith(b"\n"):
                raise DataError(f"{where}: line longer than max_line_chars={max_line_chars}")
            try:
                text = raw.decode("utf-8").removesuffix("\n").removesuffix("\r")
            except UnicodeDecodeError:
                raise DataError(f"{where}: bytes that are not UTF-8") from None
            if len(text) > max_line_chars:
                raise DataError(f"{where}: line has {len(text)} characters, more than max_line_chars={max_line_chars}")
            if text.strip():
                yield Line(number, text, offset)
            number += 1


# ---- why a file cannot be read ------------------------------------------------------------------------------


class DamagedFileError(CheckpointError, DataError):
    """A file whose bytes are not what its kind must be (a tokenizer.json that is not JSON or not a
    tokenizer): exit code 3, as for any damaged file (config.json, a safetensors header); also a
    :class:`~attnlab.errors.DataError` (a ``ValueError``) for callers that catch those."""


_REASONS = {
    errno.ENOENT: "missing (no such file)",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ELOOP: "a symlink loop (too many levels of symbolic links)",
    errno.ENOTDIR: "a component of the path is not a folder",
    errno.EISDIR: "a folder, not a file",
    errno.ENAMETOOLONG: "a name too long for the file system",
    errno.ENOSPC: "no space left on the device",
    errno.EROFS: "a read-only file system",
    errno.EIO: "an input/output error of the device",
    errno.ENXIO: "no such device",
}
_DENIED = (errno.EACCES, errno.EPERM)


def describe_os_error(error: OSError) -> str:
    """``error``'s cause in words with its errno's name: ``permission denied (EACCES)``, ``a symlink
    loop (too many levels of symbolic links) (ELOOP)``; never Python's ``[Errno 13] ...: 'path'``."""
    code = error.errno
    if code is None:
        return str(error) or type(error).__name__
    reason = _REASONS.get(code) or (error.strerror or "error").lower()
    return f"{reason} ({errno.errorcode.get(code, code)})"


@dataclass(frozen=True)
class FileProblem:
    """Why the path ``path`` cannot be read as a regular file.

    Attributes:
        path: the path, as given.
        cause: what stands in the file's place, in words (``missing (no such file) (ENOENT)``,
            ``permission denied (EACCES)``, ``a FIFO (named pipe), not a regular file``, ...).
        missing: nothing at all is there (not even a broken symlink): a file that may be absent.
        denied: the system refuses to open it (EACCES, EPERM).
    """

    path: str
    cause: str
    missing: bool = False
    denied: bool = False

    @property
    def message(self) -> str:
        return f"{self.path}: {self.cause}"

    def error(self, damaged: type[AttnlabError] = CheckpointError) -> AttnlabError:
        """The error to raise: a :class:`~attnlab.errors.DataError` (exit 2, a file the system
        refuses, as docs/reliability.md's table says) where access is denied, else ``damaged``
        (default :class:`~attnlab.errors.CheckpointError`, exit 3: a model folder missing a file,
        or with a FIFO, a device, a folder or a symlink loop in its place)."""
        return DataError(self.message) if self.denied else damaged(self.message)


_KINDS = {
    stat.S_IFDIR: "a folder, not a file",
    stat.S_IFIFO: "a FIFO (named pipe), not a regular file",
    stat.S_IFCHR: "a character device, not a regular file",
    stat.S_IFBLK: "a block device, not a regular file",
    stat.S_IFSOCK: "a socket, not a regular file",
}


def file_problem(path: str | os.PathLike[str]) -> FileProblem | None:
    """Why ``path`` cannot be read as a regular file, or None where it can.

    The path is stat'ed (following symlinks); only a regular file is then opened, without waiting
    (``O_NONBLOCK``), and closed at once, to learn whether this user may read it. A FIFO or device
    is never opened, so nothing blocks and nothing is read. A symlink whose target does not exist
    is named with its target (it is not ``missing``: a Hugging Face cache whose blob was deleted).
    """
    name = os.fspath(path)
    try:
        info = os.stat(name)
    except OSError as error:
        if error.errno == errno.ENOENT and os.path.islink(name):
            return FileProblem(name, f"a symlink to {os.readlink(name)!r}, which does not exist (ENOENT)")
        missing = error.errno in (errno.ENOENT, errno.ENOTDIR)
        return FileProblem(name, describe_os_error(error), missing=missing, denied=error.errno in _DENIED)
    kind = stat.S_IFMT(info.st_mode)
    if kind != stat.S_IFREG:
        through = f" (a symlink to {os.readlink(name)!r})" if os.path.islink(name) else ""
        return FileProblem(name, _KINDS.get(kind, "not a regular file") + through)
    try:
        os.close(os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
    except OSError as error:
        return FileProblem(name, describe_os_error(error), denied=error.errno in _DENIED)
    return None
