"""One writer per run directory: an OS file lock on ``RUN/.lock``.

Every command that writes a run directory (``train``, ``train --resume``, ``heads prune``,
``import bert``) holds :class:`RunLock` while it writes; a second writer gets a
:class:`~attnlab.errors.UsageError` (exit 2) naming the holder's PID, host and start time. Readers
(``eval``, ``generate``, ``attention``, ``view``, ``heads importance``) never take it.

The lock is ``flock(LOCK_EX | LOCK_NB)`` on the file, not the file itself: the kernel releases it
when the holding process ends in any way (kill -9 included), so a lock is never stale. The file
stays behind and its presence means nothing; the holder writes its PID, host and start time into
it only so that the error can name them. Deleting the file on release would let two processes
lock two different files of the same name, so it is never deleted.

``flock`` is advisory and local: it keeps attnlab processes apart on one machine (and on network
file systems only where they pass flock on to the server).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from types import TracebackType

from attnlab.errors import UsageError

__all__ = ["LOCK_NAME", "RunLock"]

LOCK_NAME = ".lock"
"""The lock file's name inside a run directory."""

_HOLDER_WAIT_S = 1.0
"""How long a refused writer waits for the holder to write its PID (it does so right after locking)."""


class RunLock:
    """An exclusive, non-blocking lock on a run directory, as a context manager.

    Args:
        directory: the run directory; it must exist.
        enabled: False makes a lock that does nothing (the ranks other than 0 under torchrun,
            which never write the run).

    Raises (on entry, or :meth:`acquire`):
        UsageError: another process holds the lock (the message names its PID, host and start
            time), or the lock file cannot be opened.
    """

    def __init__(self, directory: str | os.PathLike[str], *, enabled: bool = True) -> None:
        self.directory = Path(directory)
        self.path = self.directory / LOCK_NAME
        self.enabled = enabled
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> RunLock:
        """Take the lock and write this process's PID, host and start time into the file."""
        if not self.enabled or self._fd is not None:
            return self
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(
                f"run directory {self.directory} is being written by another process "
                f"({self._holder()}); wait for it to finish or stop it"
            ) from None
        except OSError as error:  # a file system without flock
            os.close(fd)
            raise UsageError(f"cannot lock {self.path}: {error.strerror}") from None
        self._fd = fd
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return self

    def release(self) -> None:
        """Clear the holder record and unlock (the file stays; see the module docstring)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.release()

    def _open(self) -> int:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as error:
            raise UsageError(f"cannot lock {self.path}: {error.strerror}") from None

    def _holder(self) -> str:
        """'PID 123 on host h since 2026-...' from the lock file, waiting briefly for a holder that
        has just locked but not yet written it."""
        deadline = time.monotonic() + _HOLDER_WAIT_S
        while True:
            record = _read_record(self.path)
            if record is not None:
                return f"PID {record.get('pid')} on host {record.get('host')} since {record.get('started')}"
            if time.monotonic() > deadline:
                return "its PID is not recorded in " + str(self.path)
            time.sleep(0.01)


def _read_record(path: Path) -> dict | None:
    try:
        record = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    return record if isinstance(record, dict) and "pid" in record else None
