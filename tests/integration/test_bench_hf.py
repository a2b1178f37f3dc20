"""`attnlab bench hf --quick`: tiny Hugging Face checkpoints opened by attnlab and by transformers,
every measurement reported in the agreed JSON (no timing asserted)."""

from __future__ import annotations

import math

import pytest

from attnlab.bench.hf import MODELS
from tests.cli import quick_bench

pytest.importorskip("transformers", reason="transformers (the [dev] extra) is needed")

FRESH_PROCESS = {"fresh_process_open_vs_hf", "open_rss_vs_weights", "first_logits_rss_vs_weights"}
PER_DTYPE = {"prefill_vs_hf_batch2", "decode_vs_hf_batch2"}


def test_quick_reports_every_figure_of_every_family():
    report = quick_bench("hf")
    assert report["benchmark"] == "hf"
    assert {"torch", "threads", "cpu"} <= set(report["machine"])
    assert all({"system", "metric", "value", "unit"} == set(r) for r in report["results"])
    ratios, notes = report["ratios"], report["notes"]
    assert all(math.isfinite(value) and value >= 0 for value in ratios.values())
    assert set(report["targets"]) <= set(ratios)
    tl_installed = not any("TransformerLens is not installed" in note for note in notes)
    opened = [family for family in MODELS if f"{family}-tiny.open_vs_hf" in ratios]
    assert {"gpt2", "llama"} <= set(opened)  # the families attnlab opens today
    for family in MODELS:  # every family is measured, or skipped with the reason
        if family not in opened:
            assert any(note.startswith(f"{family}-tiny: skipped, attnlab does not open it yet") for note in notes)
            continue
        label = f"{family}-tiny"
        expected = {f"{label}.open_vs_hf"}
        for dtype in ("float32", "bfloat16"):
            expected |= {f"{label}.{dtype}.{name}" for name in PER_DTYPE}
            if tl_installed:
                expected.add(f"{label}.{dtype}.cached_forward_vs_transformer_lens")
                expected.add(f"{label}.{dtype}.cached_forward_vs_transformer_lens_without_result")
        assert expected <= set(ratios), expected - set(ratios)
    # --quick measures each system in a fresh process once, on the first model opened.
    label = f"{opened[0]}-tiny"
    fresh = {f"{label}.{name}" for name in FRESH_PROCESS} | {
        f"{label}.hf_{name}" for name in FRESH_PROCESS if "rss" in name
    }
    assert {name for name in ratios if "rss" in name or "fresh_process" in name} == fresh
    # The peak up to the first logits includes the peak up to the open model; the RSS grows from
    # torch's import to the system's.
    for prefix in (f"{label}.", f"{label}.hf_"):
        assert ratios[f"{prefix}first_logits_rss_vs_weights"] >= ratios[f"{prefix}open_rss_vs_weights"]
    mb = {(r["system"], r["metric"]): r["value"] for r in report["results"]}
    for system in ("attnlab", "hf"):
        assert mb[f"{system} {label}", "rss_after_imports"] >= mb[f"python {label}", "rss_with_torch_imported"] > 50
