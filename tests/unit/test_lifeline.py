"""attnlab.lifeline: a launched process dies with its launcher, and at once when the launcher was
gone before it asked; the launcher's report of a worker that died of a signal
(attnlab.cli.processes): which failure it names, and the line.

The processes here run Python alone (no torch): each check takes a fraction of a second."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from attnlab.cli.processes import _died, _first_failure
from attnlab.lifeline import LAUNCHER_ENV

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")

FOLLOW = "from attnlab.lifeline import follow_launcher; follow_launcher(); print('following', flush=True)"

LAUNCHER = f"""
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", {FOLLOW + "; import time; time.sleep(60)"!r}],
                         env={{**os.environ, {LAUNCHER_ENV!r}: str(os.getpid())}}, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "following\\n"
print(child.pid, flush=True)
os._exit(0)  # the launcher ends as a kill -9 would: no code of its own on the way out
"""
"""A launcher that starts a follower, waits until it follows, and ends without a word to it."""


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env={**os.environ, **env}
    )


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0]  # noqa: PTH123, SIM115
    except OSError:
        return False
    return state not in ("Z", "X")


@linux
def test_a_follower_dies_with_its_launcher() -> None:
    launcher = _python(LAUNCHER)
    assert launcher.returncode == 0, launcher.stderr
    follower = int(launcher.stdout)
    deadline = time.monotonic() + 5
    while _alive(follower) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _alive(follower)


def test_a_follower_whose_launcher_is_gone_already_dies_at_once() -> None:
    """The launcher named in the environment is not the parent (it ended, the process was re-parented)."""
    gone = _python(FOLLOW, **{LAUNCHER_ENV: str(os.getppid())})  # the child's parent is this process
    assert gone.returncode == -signal.SIGKILL and gone.stdout == ""


def test_a_process_no_launcher_started_runs_on() -> None:
    """One process, no launcher (nothing in the environment, no WORLD_SIZE): nothing to follow."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in (LAUNCHER_ENV, "WORLD_SIZE", "TORCHELASTIC_RUN_ID")
    }
    alone = subprocess.run([sys.executable, "-c", FOLLOW], capture_output=True, text=True, timeout=60, env=env)
    assert alone.returncode == 0 and alone.stdout == "following\n"


def test_the_variable_is_not_passed_on() -> None:
    """A follower's own children do not take its launcher for theirs."""
    code = f"import os; {FOLLOW}; print(os.environ.get({LAUNCHER_ENV!r}))"
    env = f"{{**os.environ, {LAUNCHER_ENV!r}: str(os.getpid())}}"
    child = _python(f"import os, subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}], env={env})")
    assert child.returncode == 0 and child.stdout == "following\nNone\n"


def _failure(local_rank: int, exitcode: int) -> SimpleNamespace:
    return SimpleNamespace(local_rank=local_rank, exitcode=exitcode)


@pytest.mark.parametrize(
    ("failures", "named"),
    [
        ({1: _failure(1, -9), 0: _failure(0, -15)}, 1),  # killed; the other stopped by the launcher
        ({0: _failure(0, 1), 1: _failure(1, -9)}, 1),  # rank 0's collective cut by rank 1's death
        ({0: _failure(0, 2), 1: _failure(1, -15)}, 0),  # an error rank 0 printed; rank 1 stopped
        ({1: _failure(1, -15), 0: _failure(0, -15)}, 1),  # SIGTERM alone: the first found
    ],
)
def test_the_failure_named_is_the_cause(failures, named) -> None:  # noqa: ANN001
    assert _first_failure(failures)[0] == named


def test_the_line_names_the_worker_its_rank_and_the_signal() -> None:
    assert _died(3, _failure(1, -9), "rerun") == "worker 1 (rank 3) died of SIGKILL; rerun"
    assert _died(0, _failure(0, -11), "") == "worker 0 (rank 0) died of SIGSEGV"
    assert _died(0, _failure(0, -200), "") == "worker 0 (rank 0) died of signal 200"
