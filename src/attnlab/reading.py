"""Reading the text files a person names: one reader, with a size cap.

Corpora, ``--texts``, ``--pairs``, configs, word vectors and tokenizer files all go through
:func:`read_capped`, so no input is read without a bound (:data:`attnlab.limits.MAX_INPUT_BYTES`).
"""

from __future__ import annotations

import os
import stat

from attnlab.errors import DataError
from attnlab.limits import MAX_INPUT_BYTES

__all__ = ["read_capped"]


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
