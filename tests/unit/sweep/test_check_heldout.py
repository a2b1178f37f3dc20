"""tools/check_heldout.py, the held-out checks docs/sweeps.md reruns: each claim judged on hand-made
results rows (holding, and failing where one run breaks it), without training anything."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("check_heldout", ROOT / "tools" / "check_heldout.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_heldout"] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules["check_heldout"]


def _row(horizon: int, *, fits: bool = True, first_bin: bool = False, second_bin: bool = False) -> dict:
    return {
        "status": "ok",
        "valid.trained": fits,
        "length_bins.horizon": horizon,
        "length_51_100.passes": first_bin,
        "length_101_150.passes": second_bin,
        "length_51_100.accuracy": 0.9,
        "length_101_150.accuracy": 0.5,
    }


def _check(tool, name: str):
    return next(check for check in tool.CHECKS if check.name == name)


def test_dyck1_without_positions_holds_on_fitting_runs_past_50_and_fails_on_one_stuck_at_50(tool):
    check = _check(tool, "bhattamishra2020-dyck1-none")
    rows = [_row(150, first_bin=True, second_bin=True), _row(78), _row(114, first_bin=True)]
    held, lines = tool.judge(check, rows)
    assert held, lines
    assert "measured: 1 of 3 reach 150 (horizons 78, 114, 150)" in "\n".join(lines)
    held, lines = tool.judge(check, [*rows, _row(50)])
    assert not held and "FAILS: every run is right past its training lengths (horizon > 50)" in "\n".join(lines)
    held, lines = tool.judge(check, [*rows, _row(150, fits=False, first_bin=True, second_bin=True)])
    assert not held and "FAILS: every run fits" in "\n".join(lines)


def test_sinusoidal_claims_fail_when_a_run_passes_a_bin_and_a_failed_run_fails_the_check(tool):
    check = _check(tool, "bhattamishra2020-dyck1-sinusoidal")
    rows = [_row(90), _row(52, fits=False), _row(60)]
    held, lines = tool.judge(check, rows)
    assert held, lines
    assert "measured: 2 of 3 fit (valid trained)" in "\n".join(lines)
    held, lines = tool.judge(check, [*rows, _row(100, first_bin=True)])
    assert not held and "FAILS: no run is right (≥ 0.95) at every length of 51-100" in "\n".join(lines)
    held, _ = tool.judge(check, [*rows, {"status": "failed"}])  # a run that did not finish: not checked
    assert not held


def test_learned_positions_fail_at_the_first_unseen_length(tool):
    check = _check(tool, "bhattamishra2020-dyck1-learned")
    assert tool.judge(check, [_row(50), _row(50)])[0]
    assert not tool.judge(check, [_row(50), _row(52)])[0]
    assert not tool.judge(check, [])[0]  # nothing ran: nothing holds


def test_the_doc_names_the_checks_command_and_seeds(tool):
    doc = (ROOT / "docs" / "sweeps.md").read_text(encoding="utf-8")
    assert "python tools/check_heldout.py" in doc and f"seeds {tool.SEEDS}" in doc
    for check in tool.CHECKS:
        command = " ".join(tool.sweep_command(check, Path("sweeps/heldout"), 2))
        assert command.startswith(f"attnlab sweep {check.config} --grid ") and "--seeds 10-14" in command
    assert tool.main(["--out", "unused", "-k", "no-such-check"]) == 2
    assert tool.main(["--out", "unused", "--jobs", "0"]) == 2
