"""`attnlab bench tl --quick`: attnlab against TransformerLens on a tiny random Llama: every task
timed and measured for every system, in the agreed JSON, and the systems computing the same head
importance and the same head patching (no timing asserted)."""

from __future__ import annotations

import math

import pytest

from tests.cli import quick_bench

pytest.importorskip("transformers", reason="transformers (the [dev] extra) is needed")

TASKS = ("cache all", "cache patterns", "patch heads", "importance", "generate")


def test_quick_times_every_task_and_the_systems_agree():
    report = quick_bench("tl")
    assert report["benchmark"] == "tl"
    values = {(r["system"], r["metric"]): r["value"] for r in report["results"]}
    systems = {r["system"] for r in report["results"]} - {"attnlab forward (no cache)"}
    assert "attnlab" in systems
    for system in systems:
        for task in TASKS:
            assert values[(system, f"{task} s")] > 0
    assert values[("attnlab", "cache patterns cached bytes")] < values[("attnlab", "cache all cached bytes")]
    assert all(math.isfinite(value) and value >= 0 for value in report["ratios"].values())
    assert set(report["targets"]) <= set(report["ratios"])
    for system in systems - {"attnlab"}:  # TransformerLens, where installed
        assert values[(system, "importance max |difference| from attnlab")] < 1e-6
        assert values[(system, "patching max |difference| from attnlab")] < 1e-4
        for task in TASKS:
            assert f"{task}.{system}_vs_attnlab_time" in report["ratios"]
