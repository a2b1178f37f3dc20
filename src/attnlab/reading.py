"""Reading the text files a person names: whole with a size cap, or line by line at any size.

Configs, ``--pairs``, word vectors, tokenizer files and the corpora a task holds in memory go
through :func:`read_capped`, so no input is read without a bound
(:data:`attnlab.limits.MAX_INPUT_BYTES`). A corpus streamed by a corpus run (``eval --texts``,
``heads importance | ablate | detect --texts``, :mod:`attnlab.analysis.corpus`) is read by
:func:`stream_lines` instead: line by line from a byte offset, so its size is unbounded and the
memory is bounded by the longest line allowed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from attnlab.errors import DataError
from attnlab.limits import MAX_INPUT_BYTES

__all__ = ["read_capped", "Line", "stream_lines"]

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
