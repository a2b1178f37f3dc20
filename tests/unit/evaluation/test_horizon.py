"""attnlab.evaluation.horizon: the generalisation horizon of one evaluation and over length bins,
and the binomial standard error."""

from __future__ import annotations

import math

import pytest

from attnlab.evaluation.horizon import binomial_se, chained_horizon, first_failing_length, horizon


def test_every_length_passing_gives_the_highest_length():
    assert horizon({21: 1.0, 22: 0.97, 23: 0.95, 24: 1.0}, 0.95, low=21) == 24


def test_a_first_length_failing_gives_the_length_below_the_evaluation():
    assert horizon({21: 0.94, 22: 1.0, 23: 1.0}, 0.95, low=21) == 20
    assert horizon({}, 0.95, low=21) == 20  # nothing evaluated: nothing claimed


def test_a_gap_in_the_middle_stops_the_horizon_at_the_last_length_before_it():
    accuracy = {21: 1.0, 22: 1.0, 23: 0.5, 24: 1.0, 25: 1.0}
    assert horizon(accuracy, 0.95, low=21) == 22
    assert horizon(accuracy, 0.5, low=21) == 25  # at threshold 0.5, 0.5 passes


def test_absent_odd_lengths_are_skipped_not_failed():
    """A Dyck language read by next_char has no odd lengths: the even ones decide."""
    even = {22: 1.0, 24: 1.0, 26: 0.96, 28: 0.2, 30: 1.0}
    assert horizon(even, 0.95, low=21) == 26
    assert horizon({22: 0.1, 24: 1.0}, 0.95, low=21) == 20


def test_a_bins_own_verdict_is_its_first_failing_length_or_none_when_it_passes():
    """Of a bin 101..150 that fails at once, the first failing length (102 for Dyck's even lengths),
    not the floor 100 its horizon reads."""
    assert first_failing_length({102: 0.2, 104: 1.0}, 0.95) == 102
    assert horizon({102: 0.2, 104: 1.0}, 0.95, low=101) == 100
    assert first_failing_length({22: 1.0, 24: 1.0, 26: 0.96, 28: 0.2, 30: 0.0}, 0.95) == 28
    assert first_failing_length({41: 0.5, 21: 1.0}, 0.95) == 41  # read in order of length
    assert first_failing_length({21: 1.0, 22: 0.95}, 0.95) is None
    assert first_failing_length({}, 0.95) is None


def _bin(low: int, high: int, reached: int) -> dict:
    return {"length_range": [low, high], "horizon": reached}


def test_the_horizon_runs_on_into_the_next_bin_only_when_one_passed_whole_and_the_next_follows():
    assert chained_horizon([_bin(21, 40, 40), _bin(41, 80, 57)]) == 57
    assert chained_horizon([_bin(41, 80, 57), _bin(21, 40, 40)]) == 57  # read in order of their lows
    assert chained_horizon([_bin(21, 40, 34), _bin(41, 80, 80)]) == 34  # the first bin fails at 35 or 36
    assert chained_horizon([_bin(21, 40, 40), _bin(81, 120, 120)]) == 40  # 41..80 were not evaluated
    assert chained_horizon([_bin(21, 40, 40), _bin(41, 80, 40)]) == 40  # the next bin fails at once
    assert chained_horizon([]) is None


def test_a_chain_starting_past_the_first_unseen_length_claims_only_the_training_lengths():
    """Trained on 1..10 and scored on 21..40 alone: 11..20 were never evaluated, so a model that
    fails at 21 (the bin's own horizon, 20) has a horizon of 10, not 20."""
    assert chained_horizon([_bin(21, 40, 20)], trained_up_to=10) == 10
    assert chained_horizon([_bin(21, 40, 40)], trained_up_to=10) == 10
    assert chained_horizon([_bin(11, 20, 14), _bin(21, 40, 40)], trained_up_to=10) == 14
    assert chained_horizon([_bin(11, 20, 20), _bin(21, 40, 33)], trained_up_to=10) == 33
    assert chained_horizon([_bin(51, 100, 78)], trained_up_to=50) == 78


def test_binomial_standard_error():
    assert binomial_se(0.8, 400) == pytest.approx(0.02)
    assert binomial_se(1.0, 50) == 0.0
    assert binomial_se(0.5, 1) == 0.5
    assert math.isnan(binomial_se(0.5, 0))
