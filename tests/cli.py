"""Running the ``attnlab`` command in a fresh process, as a user's shell does (its exit code,
stdout and stderr), for the integration tests."""

from __future__ import annotations

import os
import subprocess
import sys


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
