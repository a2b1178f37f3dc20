"""Running the ``attnlab`` command in a fresh process, as a user's shell does (its exit code,
stdout and stderr), for the integration tests."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def quick_bench(name: str) -> dict:
    """``attnlab bench NAME --quick --json``'s report, asserted to exit 0. The kernels' fixed
    preferences, not a calibration in each process (ATTNLAB_CALIBRATE=0): the figures are not
    asserted, and a fresh process's first calls would time every GEMM class (seconds each)."""
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", name, "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ATTNLAB_CALIBRATE": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout)


def attnlab(*args: str, timeout: int = 300, one_thread: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m attnlab ARGS...``, its output captured as text.

    Args:
        timeout: seconds before the command is killed (the test then fails).
        one_thread: OMP_NUM_THREADS=1, for heavy commands beside another xdist worker on two cores.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if one_thread else None
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=timeout, env=env
    )
