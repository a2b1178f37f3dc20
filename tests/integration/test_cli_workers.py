"""Workers die with their parent (issue 50): a kill -9 of an `attnlab heads importance --texts FILE
--nproc 2` command leaves no worker running, no CSV and the last resume state; a worker killed
with kill -9 ends the command with one `error:` line naming its rank and signal (exit 1); Ctrl-C
of the command is one "interrupted" (exit 130). After each, `--resume` completes to the
uninterrupted run's result.

The processes are found in /proc (Linux): the command's children that run attnlab.cli.worker, the
worker's rank in its environment."""

from __future__ import annotations

import csv
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.cli import main
from tests.unit.analysis.tiny_lm import tiny_lm_run

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and the parent-death signal")

WORDS = "the cat sat on a mat dog ran far away big small red x".split()

LINES = 600
"""Texts enough that two processes are still at work seconds after their first saved state
(a window is 2 x 8 x 2 = 32 lines)."""

WAIT = 120.0
"""Seconds to wait for the workers' first state (two fresh processes import torch on shared cores)."""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:  # noqa: ANN001
    """A tiny language model (1 layer) and LINES short texts."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 5))) for _ in range(LINES)]
    return tiny_lm_run(tmp_path_factory.mktemp("cli_workers"), texts=lines, layers=1)


@pytest.fixture(scope="module")
def whole(corpus, tmp_path_factory) -> list[float]:  # noqa: ANN001
    """The uninterrupted run's importances (one process, in this one)."""
    out = tmp_path_factory.mktemp("whole") / "whole.csv"
    assert _run_here(*_common(corpus), "--out", str(out)) == 0
    return _importances(out)


def _common(corpus: tuple[Path, Path]) -> tuple[str, ...]:
    run, texts = corpus
    return ("heads", "importance", str(run), "--texts", str(texts), "--batch-size", "2", "--no-progress")


def _run_here(*args: str) -> int:
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return int(exit_info.value.code or 0)


def _importances(path: Path) -> list[float]:
    with open(path, newline="") as handle:
        return [float(row["importance"]) for row in csv.DictReader(handle)]


def _start(corpus: tuple[Path, Path], out: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "attnlab", *_common(corpus), "--out", str(out), "--nproc", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


def _workers(parent: int) -> dict[int, int]:
    """The worker processes ``parent`` started: local rank -> PID."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
            environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
        except OSError:  # gone meanwhile
            continue
        if int(stat.rpartition(")")[2].split()[1]) == parent and b"attnlab.cli.worker" in cmdline:
            rank = next(v for v in environ if v.startswith(b"LOCAL_RANK=")).partition(b"=")[2]
            found[int(rank)] = int(entry)
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is a process that runs (not gone, not a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def _first_state(process: subprocess.Popen[str], state: Path) -> dict[int, int]:
    """Wait until ``state`` is written (a window done); the workers then running."""
    deadline = time.monotonic() + WAIT
    while not state.exists():
        assert process.poll() is None, process.communicate()[1]
        assert time.monotonic() < deadline, "no state written"
        time.sleep(0.02)
    workers = _workers(process.pid)
    assert sorted(workers) == [0, 1], workers
    return workers


def _resume_gives(corpus: tuple[Path, Path], out: Path, state: Path, whole: list[float]) -> None:
    assert state.exists() and not out.exists()
    assert _run_here(*_common(corpus), "--out", str(out), "--resume") == 0
    assert _importances(out) == pytest.approx(whole, rel=1e-6, abs=1e-9)
    assert not state.exists()


def test_a_killed_parent_leaves_no_worker_and_resume_continues(corpus, whole, tmp_path) -> None:
    out, state = tmp_path / "part.csv", tmp_path / "part.resume.json"
    command = _start(corpus, out)
    try:
        workers = _first_state(command, state)
    finally:
        command.kill()
        command.communicate()
    deadline = time.monotonic() + 3
    while any(map(_running, workers.values())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers.values() if _running(pid)], "workers outlived their parent"
    _resume_gives(corpus, out, state, whole)


@pytest.mark.slow  # a second pair of processes: about 15 s on two shared cores
def test_a_dead_worker_is_one_error_line_and_resume_continues(corpus, whole, tmp_path) -> None:
    out, state = tmp_path / "part.csv", tmp_path / "part.resume.json"
    command = _start(corpus, out)
    try:
        workers = _first_state(command, state)
        os.kill(workers[1], signal.SIGKILL)
        _, err = command.communicate(timeout=60)
    finally:
        command.kill()
    assert command.returncode == 1, err
    assert err.splitlines() == [
        "error: worker 1 (rank 1) died of SIGKILL; the saved state is kept: rerun with --resume to continue"
    ]
    assert not [pid for pid in workers.values() if _running(pid)]
    _resume_gives(corpus, out, state, whole)


@pytest.mark.slow  # a third pair of processes
def test_ctrl_c_of_the_parent_is_one_word_and_resume_continues(corpus, whole, tmp_path) -> None:
    """SIGINT (Ctrl-C) reaches the parent alone; it stops the workers, which end without a word."""
    out, state = tmp_path / "part.csv", tmp_path / "part.resume.json"
    command = _start(corpus, out)
    try:
        workers = _first_state(command, state)
        command.send_signal(signal.SIGINT)
        _, err = command.communicate(timeout=60)
    finally:
        command.kill()
    assert command.returncode == 130 and err.splitlines() == ["interrupted"], err
    assert not [pid for pid in workers.values() if _running(pid)]
    _resume_gives(corpus, out, state, whole)
