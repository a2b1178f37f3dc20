"""A launched process dies with the process that launched it.

``attnlab ... --nproc N`` runs its command again on N worker processes, started by PyTorch's
elastic launcher inside the ``attnlab`` process (:func:`attnlab.cli.processes.launch`), each in a
session of its own (so that Ctrl-C reaches the launcher alone, which stops them). A launcher that
is killed outright (kill -9, the OOM killer) runs no code on its way out: without more, its
workers would be re-parented to PID 1 (or a subreaper), finish the run and write its results
behind the back of a command that had already ended.

:func:`follow_launcher`, called first thing in a worker, ties the worker's life to its parent's:

* on Linux, ``prctl(PR_SET_PDEATHSIG, SIGKILL)``: the kernel kills the worker when its parent
  ends. SIGKILL, not SIGTERM: a worker blocked in a collective (gloo, NCCL) runs no Python signal
  handler, and no code of a worker whose launcher is gone may run (a result written, a resume
  state removed). The parent's *thread* counts: the launcher starts its workers from the thread
  that runs the command, which lives as long as the command;
* elsewhere (or when prctl fails), a daemon thread that polls :func:`os.getppid` every
  :data:`POLL_SECONDS` and kills the process when its parent has changed;
* in both cases, a parent that had already ended before the call (the worker then belongs to
  another process) ends the worker at once: the launcher gives its own PID in the environment
  variable :data:`LAUNCHER_ENV`, which the worker compares with :func:`os.getppid` (and then
  removes from its environment, so that no process it starts takes it for its own launcher).

:func:`orphaned` is the same comparison, and :func:`stop_if_orphaned` acts on it, for code about
to make a run's end final (write its results, remove its resume state): a last check where the
kernel's signal cannot help (the polling thread between two polls).

This module imports nothing of attnlab (any layer may use it) and no third-party package.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["LAUNCHER_ENV", "POLL_SECONDS", "follow_launcher", "orphaned", "stop_if_orphaned"]

LAUNCHER_ENV = "ATTNLAB_LAUNCHER_PID"
"""The environment variable in which a launcher gives its workers its PID."""

POLL_SECONDS = 0.25
"""How often the polling thread (where prctl is missing) looks at the parent's PID."""

PR_SET_PDEATHSIG = 1
"""prctl's option: the signal the kernel sends this process when its parent ends (linux/prctl.h)."""

_followed: dict[str, int] = {}
"""The parent PID :func:`follow_launcher` follows (key "pid"), once it has been called."""


def orphaned() -> bool:
    """Whether the parent this process follows (:func:`follow_launcher`) has ended; False when it
    follows none."""
    expected = _followed.get("pid")
    return expected is not None and os.getppid() != expected


def stop_if_orphaned() -> None:
    """End this process at once (SIGKILL) if the parent it follows has ended (:func:`orphaned`)."""
    if orphaned():
        _die()


def follow_launcher() -> None:
    """End this process (SIGKILL) when its parent ends, and now if it has ended already (see the
    module docstring). A no-op outside a launched process; calling it again changes nothing."""
    if "pid" in _followed:
        return
    value = os.environ.pop(LAUNCHER_ENV, "")
    if value.isdigit() and int(value) > 1:
        expected = int(value)
    elif _launched_by_torchrun():
        expected = os.getppid()  # a torchrun of one's own: its agent is the parent
    else:
        return
    _followed["pid"] = expected
    if not _parent_death_signal(signal.SIGKILL):
        threading.Thread(target=_watch, args=(expected,), name="attnlab-lifeline", daemon=True).start()
    if os.getppid() != expected:  # the launcher ended before the signal was asked for
        _die()


def _launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def _parent_death_signal(sig: signal.Signals) -> bool:
    """Ask the kernel for ``sig`` when the parent ends (Linux's prctl); whether it took."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc prctl (another libc, a sandbox)
        return False


def _watch(expected: int) -> None:
    """The polling thread: end the process once its parent is not ``expected``."""
    while os.getppid() == expected:
        time.sleep(POLL_SECONDS)
    _die()


def _die() -> None:
    """End this process at once, running no more of its code (no result written, nothing removed)."""
    os.kill(os.getpid(), signal.SIGKILL)
