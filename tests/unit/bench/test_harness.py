"""The harness's hooks for benchmarks whose systems run elsewhere or stream their rows: a system
timed by its own clock (:class:`Timed`), a step after every call (a progress bar), and each
measurement handed on as it is added. No timing is asserted."""

from __future__ import annotations

import json

import pytest

from attnlab.bench.harness import BenchResult, Measurement, Timed, format_row, format_table, interleaved_median_times


def test_a_system_timed_elsewhere_gives_its_own_seconds_per_unit():
    answers = iter([Timed(9.0), Timed(2.0, units=4), Timed(1.0, units=4), Timed(3.0, units=4), Timed(4.0, units=2)])
    medians = interleaved_median_times({"peer": lambda: next(answers)}, repeats=5, warmup=0)
    assert medians == {"peer": 0.75}  # the median of 9, 0.5, 0.25, 0.75, 2
    with pytest.raises(ValueError, match="at least one"):
        interleaved_median_times({"peer": lambda: Timed(1.0, units=0)}, repeats=5, warmup=0)


def test_tick_follows_every_call_warm_up_included():
    ticks = []
    interleaved_median_times({"a": lambda: None, "b": lambda: None}, repeats=5, warmup=2, tick=lambda: ticks.append(1))
    assert len(ticks) == 2 * (2 + 5)


def test_each_measurement_is_echoed_as_it_is_added_and_the_table_has_the_same_line():
    seen: list[Measurement] = []
    result = BenchResult("demo", echo=seen.append)
    result.add("attnlab", "cache all s", 0.25, "s")
    assert seen == [Measurement("attnlab", "cache all s", 0.25, "s")]
    assert format_row(seen[0]) in format_table(result).splitlines()
    assert "echo" not in json.loads(result.dumps())
