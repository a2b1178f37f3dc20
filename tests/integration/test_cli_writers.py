"""Two real ``attnlab train --resume RUN`` processes at once: one trains, the other is refused.

The holder is paused (SIGSTOP) as soon as it has the lock, so the other process meets a held lock
however the two are scheduled; then the holder goes on and finishes alone. Both run without the C++
kernels (ATTNLAB_NATIVE=0): a process paused while it held the shared kernel build's lock would
stall every other process on the machine that builds them.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnlab.experiment import ExperimentConfig
from attnlab.run.directory import RunDir
from attnlab.training.trainer import train

TINY = {
    "task": {
        "name": "reverse",
        "max_train_length": 4,
        "train_size": 64,
        "valid_size": 8,
        "test_size": 8,
        "length_generalisation_size": 4,
    },
    "model": {"kind": "encoder_decoder", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32},
    "train": {"steps": 3, "batch_size": 8, "log_every": 1, "threads": 1},
}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("writers") / "run"
    train(ExperimentConfig.from_dict(TINY), path, progress=False)
    return path


def _resume(run: Path, *settings: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "attnlab", "train", "--resume", str(run), "--no-progress"]
    for item in settings:
        command += ["--set", item]
    env = {**os.environ, "ATTNLAB_NATIVE": "0"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _holder_pid(run: Path, candidates: set[int], processes: list[subprocess.Popen[str]]) -> int:
    """The PID written into RUN/.lock by one of ``candidates`` (polled until one has the lock)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            pid = json.loads((run / RunDir.LOCK).read_text())["pid"]
        except (OSError, ValueError, KeyError):
            pid = None
        if pid in candidates:
            return pid
        if all(p.poll() is not None for p in processes):
            break
        time.sleep(0.001)
    outputs = [p.communicate() for p in processes]
    raise AssertionError(f"no process took the lock: {outputs}")


def test_two_resumes_at_once_one_is_refused_naming_the_holder(tiny_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    # train.threads=2 against the checkpoint's 1: the run that trains warns once
    processes = [_resume(run, "train.steps=30", "train.threads=2") for _ in range(2)]
    try:
        pid = _holder_pid(run, {p.pid for p in processes}, processes)
        os.kill(pid, signal.SIGSTOP)
        holder, other = sorted(processes, key=lambda p: p.pid != pid)
        _, err = other.communicate(timeout=300)
        assert other.returncode == 2, err
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
        assert f"being written by another process (PID {pid} on host " in err
        os.kill(pid, signal.SIGCONT)
        out, err = holder.communicate(timeout=300)
        assert holder.returncode == 0, err
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
                process.wait()
    warnings = [line for line in err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 1 and "threads 1 -> 2" in warnings[0], err
    records = RunDir.open(run).read_metrics()
    steps = [r["step"] for r in records if "loss" in r and "split" not in r]
    assert steps == list(range(1, 31))  # each step once: the refused process wrote nothing
    finals = [r for r in records if r.get("split") == "valid" and r["step"] == 30]
    assert len(finals) == 1
    assert (run / RunDir.LOCK).read_text() == ""  # released at the end
