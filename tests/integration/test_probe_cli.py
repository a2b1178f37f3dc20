"""The hostile probe (tools/probe_cli.py, issues 37 and 50) run whole by ``make test-all``: every case
that can run here (its fixtures installed) passes. Marked slow: it trains tiny runs and imports the
SmolLM2 GGUF file ten times (several minutes on 2 cores)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_case_of_the_probe_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "probe_cli.py")],
        capture_output=True,
        text=True,
        timeout=3600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=REPO,
    )
    table = done.stdout[done.stdout.rfind("\ncase ") :]
    failing = [
        line
        for line in table.splitlines()[1:]
        if line.strip() and not any(f"  {result}  " in line for result in ("ok", "ok-error", "skipped"))
    ]
    assert done.returncode == 0, "\n".join([*failing, done.stderr[-2000:]])
