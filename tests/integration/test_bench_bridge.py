"""`attnlab bench bridge --quick`: a tiny Llama opened natively and through the bridge (and
TransformerLens' bridge where installed): every task timed for every system, in the agreed JSON,
and the two attnlab paths computing the same head importance (no timing asserted)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from tests.cli import quick_bench

pytest.importorskip("transformers", reason="transformers (the [dev] extra) is needed")

TASKS = ("forward", "cache all", "importance", "patch heads")


def test_quick_times_every_task_on_both_paths_and_they_agree():
    report = quick_bench("bridge")
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


def test_the_gpu_benchmark_runs_every_task_on_the_cpu_with_quick_and_refuses_without_a_gpu():
    report = quick_bench("gpu")
    tasks = {m["metric"] for m in report["results"]}
    assert {"forward s", "cache all s", "importance s", "patch heads s", "generate s"} <= tasks
    systems = {m["system"] for m in report["results"]}
    assert {"attnlab quick", "transformers quick"} <= systems
    if not torch.cuda.is_available():
        done = subprocess.run([sys.executable, "-m", "attnlab", "bench", "gpu"], capture_output=True, text=True)
        assert done.returncode == 2 and done.stderr.strip().endswith("--quick runs its code paths on the CPU")
