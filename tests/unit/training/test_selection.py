"""Model selection, the early stop and the oracle report, on hand-made evaluation histories."""

from __future__ import annotations

import pytest

from attnlab.training.selection import ORACLE_LABEL, SELECTORS, Evaluation, oracle_report, select, stop_reached


def _history() -> list[Evaluation]:
    # valid peaks at step 200 (tied at 300 with a higher loss); the bins peak elsewhere
    rows = [
        (100, 0.50, 0.9, 0.10, 0.00),
        (200, 0.90, 0.3, 0.40, 0.05),
        (300, 0.90, 0.4, 0.70, 0.20),
        (400, 0.80, 0.5, 0.60, 0.35),
    ]
    return [
        Evaluation(step, {"valid": valid, "length_51_100": a, "length_101_150": b}, {"valid": loss})
        for step, valid, loss, a, b in rows
    ]


def test_last_picks_the_last_step_whatever_the_history():
    assert select("last", _history(), 500).step == 500
    assert select("last", [], 7).step == 7


def test_best_valid_picks_the_best_validation_ties_to_the_lower_loss():
    chosen = select("best_valid", _history(), 500)
    assert chosen.step == 200  # 0.90 twice: step 200's valid loss 0.3 < 0.4
    assert chosen.mode == "best_valid"
    assert "0.9000" in chosen.reason and "steps 100, 200, 300, 400" in chosen.reason
    assert chosen.record() == {"select": "best_valid", "selected_step": 200, "selected_because": chosen.reason}


def test_best_valid_never_looks_at_a_test_bin():
    """Bin accuracies that would favour step 400 change nothing: only valid is read."""
    history = _history()
    boosted = [
        Evaluation(e.step, {**e.accuracy, "length_101_150": 1.0 if e.step == 400 else 0.0}, e.loss) for e in history
    ]
    assert select("best_valid", boosted, 500).step == select("best_valid", history, 500).step == 200


def test_best_valid_ties_in_accuracy_and_loss_go_to_the_earlier_step():
    history = [Evaluation(s, {"valid": 1.0}, {"valid": 0.0}) for s in (10, 20, 30)]
    assert select("best_valid", history, 30).step == 10


def test_best_valid_without_any_validation_falls_back_to_the_last_step():
    chosen = select("best_valid", [], 9)
    assert chosen.step == 9 and "no validation" in chosen.reason


def test_the_selectors_are_the_config_choices():
    from attnlab.experiment import SELECT_MODES

    assert tuple(SELECTORS) == SELECT_MODES


def test_the_oracle_is_the_best_per_bin_each_at_its_own_step_and_labelled():
    report = oracle_report(_history(), ["length_51_100", "length_101_150", "length_151_200"])
    assert report["bins"] == {
        "length_51_100": {"accuracy": 0.70, "step": 300},
        "length_101_150": {"accuracy": 0.35, "step": 400},
    }  # a bin never scored is left out
    assert report["selected_on"] == ORACLE_LABEL == "selected on the test bins"
    assert report["evaluations"] == 4 and report["steps"] == [100, 200, 300, 400]


def test_the_oracle_is_at_least_every_selection():
    """No selection rule can beat a per-bin maximum: the oracle bounds what select reports."""
    history = _history()
    for mode in SELECTORS:
        step = select(mode, history, 400).step
        scored = next(e for e in history if e.step == step)
        for name, best in oracle_report(history, ["length_51_100", "length_101_150"])["bins"].items():
            assert best["accuracy"] >= scored.accuracy[name]


@pytest.mark.parametrize(
    ("threshold", "expected"), [(0.999, None), (0.5, pytest.approx(0.8)), (0.79, pytest.approx(0.8)), (0.81, None)]
)
def test_stop_reached_compares_the_mean_over_the_scored_splits(threshold, expected):
    evaluation = Evaluation(5, {"valid": 1.0, "length_51_100": 0.9, "length_101_150": 0.5}, {})
    assert stop_reached(evaluation, threshold) == expected


def test_an_evaluation_round_trips_through_json():
    evaluation = _history()[1]
    assert Evaluation.from_json(evaluation.to_json()) == evaluation
