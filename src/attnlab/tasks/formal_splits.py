"""What a split of a formal-language task is measured against, and how it stays free of repeats.

A classifier that only counts symbols (no positions) can score near 1 on near-miss negatives, so
every split reports the accuracy of the language's shortcut (:data:`COUNTING_BASELINES`) and of the
majority class (:func:`baseline_accuracy`); a held-out split with few distinct strings has an
accuracy with a standard error up to 0.5 / sqrt(distinct strings) (:func:`small_split_rule`).
:func:`once` draws without repeats (``task.distinct``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from attnlab.errors import ConfigError

__all__ = [
    "COUNTING_BASELINES",
    "MAX_REPEATS",
    "MIN_DISTINCT_POSITIVES",
    "MIN_DISTINCT_STRINGS",
    "baseline_accuracy",
    "majority_label",
    "once",
    "small_split_rule",
]

MIN_DISTINCT_STRINGS = 100
"""A held-out split with fewer distinct strings than this is warned about: its accuracy is a mean
over so few strings that its standard error can exceed 0.5 / sqrt(100) = 0.05."""


MIN_DISTINCT_POSITIVES = 25
"""... and so is one with fewer distinct positives (``classify``): the accuracy on its positive half
is a mean over fewer strings than this, with a standard error that can exceed 0.5 / sqrt(25) = 0.1."""


MAX_REPEATS = 1000
"""With ``distinct``, a split gives up after this many draws in a row that it already holds."""


def once(
    sampler: Callable[[random.Random], str], seen: set[str] | None, too_few: str
) -> Callable[[random.Random], str]:
    """``sampler``, drawing again while it gives a string of ``seen`` (then adding it); without
    ``seen``, ``sampler`` itself. :data:`MAX_REPEATS` repeats in a row: ConfigError ``too_few``."""
    if seen is None:
        return sampler

    def draw(rng: random.Random) -> str:
        for _ in range(MAX_REPEATS):
            string = sampler(rng)
            if string not in seen:
                seen.add(string)
                return string
        raise ConfigError(too_few)

    return draw


def small_split_rule(name: str, report: dict[str, Any], classify: bool) -> str | None:
    """Why split ``name``'s accuracy means little (:data:`MIN_DISTINCT_STRINGS`,
    :data:`MIN_DISTINCT_POSITIVES`), or None."""
    if report["distinct_strings"] < MIN_DISTINCT_STRINGS:
        return f"only {report['distinct_strings']} distinct strings (fewer than {MIN_DISTINCT_STRINGS})"
    if classify and report["distinct_positives"] < MIN_DISTINCT_POSITIVES:
        return f"only {report['distinct_positives']} distinct positive strings (fewer than {MIN_DISTINCT_POSITIVES})"
    return None


def majority_label(labels: Sequence[int | None]) -> int:
    """The more frequent label of ``labels`` (1 on a tie or when there is none)."""
    ones = sum(1 for label in labels if label == 1)
    return int(ones * 2 >= len(labels))


def _balanced_counts(s: str) -> bool:
    return s.count("(") == s.count(")") and s.count("[") == s.count("]")


def _equal_counts(letters: str) -> Callable[[str], bool]:
    return lambda s: len({s.count(letter) for letter in letters}) == 1 and len(s) > 0


COUNTING_BASELINES: dict[str, tuple[str, Callable[[str], bool] | None]] = {
    "parity": ("chance", None),
    "dyck1": ("balanced_counts", _balanced_counts),
    "dyck2": ("balanced_counts", _balanced_counts),
    "anbn": ("equal_counts", _equal_counts("ab")),
    "anbncn": ("equal_counts", _equal_counts("abc")),
}
"""Language -> the shortcut classifier its split is scored against: ``balanced_counts`` (member iff
as many openers as closers of each kind: order ignored), ``equal_counts`` (member iff every letter
occurs equally often), ``chance`` (accuracy 0.5: parity has no count to read but the 1s' parity)."""


def baseline_accuracy(language: str, strings: Sequence[str], labels: Sequence[int], majority: int) -> dict[str, Any]:
    """The accuracy of the language's shortcut classifier and of the majority class on a split.

    Args:
        language: a key of :data:`COUNTING_BASELINES`.
        strings, labels: the split's strings and their labels (1 = member).
        majority: the label the majority baseline always predicts (the training split's majority).

    Returns:
        ``baseline`` (the shortcut's name), ``baseline_accuracy`` and ``majority_accuracy``.
    """
    if not labels:
        return {}
    name, rule = COUNTING_BASELINES[language]
    if rule is None:
        accuracy = 0.5
    else:
        accuracy = sum(int(rule(s)) == label for s, label in zip(strings, labels)) / len(labels)
    return {
        "baseline": name,
        "baseline_accuracy": accuracy,
        "majority_accuracy": sum(label == majority for label in labels) / len(labels),
    }
