"""`attnlab bench bridge --quick`: a tiny Llama opened natively and through the bridge (and
TransformerLens' bridge where installed): every task timed for every system, in the agreed JSON,
and the two attnlab paths computing the same head importance (no timing asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers (the [dev] extra) is needed")

TASKS = ("forward", "cache all", "importance", "patch heads")


def test_quick_times_every_task_on_both_paths_and_they_agree():
    result = subprocess.run(
        [sys.executable, "-m", "attnlab", "bench", "bridge", "--quick", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ATTNLAB_CALIBRATE": "0"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(result.stdout)
    assert report["benchmark"] == "bridge"
    values = {(r["system"], r["metric"]): r["value"] for r in report["results"]}
    systems = {r["system"] for r in report["results"]}
    assert {"attnlab native", "attnlab bridge"} <= systems
    for system in systems:
        for task in TASKS:
            assert values[(system, f"{task} s")] > 0
    assert values[("attnlab bridge", "importance max |difference| from native (relative)")] < 1e-4
    for task in TASKS:
        assert f"{task}.bridge_vs_native_time" in report["ratios"]
    assert all(math.isfinite(value) and value >= 0 for value in report["ratios"].values())
