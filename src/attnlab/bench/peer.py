"""A benchmark's peer systems in another Python: a subprocess answering one JSON line per request.

``attnlab bench tl --python PATH`` runs TransformerLens in the environment of PATH, which needs
torch, transformers and transformer_lens but not attnlab: :class:`PeerProcess` starts ``PATH
SCRIPT`` (a standalone file shipped in this package, :mod:`attnlab.bench.peer_scripts.tl_peer`),
reads its first line (the versions it imported), then sends one request at a time and reads its answer, so
that only one of the two processes computes at any moment. The peer's stderr goes to a log file,
kept and named when the peer fails.

A Python that is not there, cannot be run, or lacks a module the peer imports is a
:class:`~attnlab.errors.UsageError` naming ``--python``; a peer that dies later is a
:class:`PeerError` with the last line of its stderr.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from attnlab.errors import EXIT_INTERNAL, AttnlabError, UsageError

__all__ = ["PeerError", "PeerProcess", "resolve_python"]

_MISSING = re.compile(r"No module named '([^']+)'")


class PeerError(AttnlabError):
    """A peer process failed or broke the protocol (its own error: the message quotes its stderr)."""

    exit_code = EXIT_INTERNAL


def resolve_python(python: str | os.PathLike[str]) -> str:
    """The path of the Python ``--python`` names: a file, or a command found on PATH.

    Args:
        python: a path, or a bare name such as ``python3.11``.

    Returns:
        The path to run.

    Raises:
        UsageError: it is not there, is a folder, or is not executable.
    """
    given = str(python)
    found = shutil.which(given) if os.sep not in given else given
    if found is None or not Path(found).exists():
        raise UsageError(f"--python {given}: no such file (the Python of an environment with TransformerLens)")
    if Path(found).is_dir():
        raise UsageError(f"--python {given}: is a folder, not a Python interpreter (its bin/python, say)")
    if not os.access(found, os.X_OK):
        raise UsageError(f"--python {given}: is not executable")
    return found


class PeerProcess:
    """``python script`` speaking the JSON-lines protocol of :mod:`~attnlab.bench.peer_scripts.tl_peer`.

    Use it as a context manager: :meth:`start` then :meth:`request` s; leaving it ends the process
    (a ``quit`` request, then a kill if it does not exit).

    Args:
        python: the interpreter (from :func:`resolve_python`, or ``sys.executable``).
        script: the peer's file.
        name: the peer in messages (``TransformerLens``).
        flag: how the user named ``python`` (``--python``), or None where attnlab chose its own.
    """

    def __init__(self, python: str, script: Path, name: str, flag: str | None) -> None:
        self.python, self.script, self.name, self.flag = python, script, name, flag
        self.process: subprocess.Popen[str] | None = None
        self.log: Path | None = None
        self.keep_log = False

    def start(self) -> dict[str, Any]:
        """Start the process and read its first line (what it imported).

        Returns:
            The first answer.

        Raises:
            UsageError: the Python cannot be run, or lacks a module the peer needs.
            PeerError: the process failed otherwise.
        """
        handle, log = tempfile.mkstemp(prefix="attnlab-peer-", suffix=".log")
        self.log = Path(log)
        try:
            with os.fdopen(handle, "w") as stderr:
                self.process = subprocess.Popen(
                    [self.python, str(self.script)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    text=True,
                    bufsize=1,
                )
        except OSError as error:
            self.log.unlink(missing_ok=True)
            raise UsageError(f"{self._python()}: cannot be run ({error.strerror or error})") from None
        return self._answer("starting")

    def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """Send one request and wait for its answer.

        Args:
            op: the request (``load``, ``time``, ``peak``).
            fields: its fields.

        Returns:
            The answer.

        Raises:
            PeerError: the process died or answered something that is not a JSON object.
        """
        doing = f"{op} {fields.get('system', '')} {fields.get('task', '')}".strip()
        try:
            self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
            self.process.stdin.flush()
        except OSError:  # a closed pipe: the process ended
            raise self._failure(doing) from None
        return self._answer(doing)

    def _answer(self, doing: str) -> dict[str, Any]:
        line = self.process.stdout.readline()
        if not line:
            raise self._failure(doing)
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            answer = None
        if not isinstance(answer, dict):
            self.close(kill=True)
            raise PeerError(f"{self.name} process ({self.python}): answered {line.strip()[:200]!r} to {doing}")
        return answer

    def _failure(self, doing: str) -> AttnlabError:
        """The error of a process that ended while ``doing``: what its stderr says last."""
        try:
            code = self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:  # its stdout closed, the process still running
            self.process.kill()
            code = self.process.wait()
        lines = [line.strip() for line in self.log.read_text(errors="replace").splitlines() if line.strip()]
        last = lines[-1] if lines else "nothing on stderr"
        missing = _MISSING.search(last)
        if missing is not None and doing == "starting":
            return UsageError(
                f"{self._python()}: that Python has no {missing.group(1)} ({last}); `bench tl` runs "
                f"TransformerLens there: install torch, transformers and transformer-lens into it"
                + (", or leave --python out" if self.flag else "")
            )
        self.keep_log = True
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return PeerError(
            f"{self.name} process ({self.python}) {how} while {doing}: {last[:500]} (its stderr: {self.log})"
        )

    def _python(self) -> str:
        return f"{self.flag} {self.python}" if self.flag else f"{self.python} (attnlab's own Python)"

    def close(self, kill: bool = False) -> None:
        """End the process: ``quit`` and wait, or kill it (``kill``, or when it does not exit in 60 s).
        Its log is removed unless a :class:`PeerError` named it."""
        if self.process is None:
            return
        process, self.process = self.process, None
        if process.poll() is None and not kill:
            try:
                process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                process.stdin.close()
                process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if process.poll() is None:
            process.kill()
            process.wait()
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        if self.log is not None and not self.keep_log:
            self.log.unlink(missing_ok=True)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        self.close(kill=kind is not None)
