"""The generalisation horizon: the longest length up to which a model is right at every length.

A bin's mean accuracy hides a cliff: a model perfect up to length 34 and wrong from 40 on scores
about 0.7 on the bin 21–40, as does one right on 70% of the strings at every length. The horizon
says where the cliff is. For an evaluation of the lengths ``low..high`` with accuracy a(n) at each
evaluated length n (a length without strings, such as an odd length of a Dyck language, is absent:
neither passed nor failed) and a threshold t (``task.horizon_threshold``, default 0.95):

    horizon = max { n : a(m) >= t for every evaluated length m <= n },

the longest evaluated length up to which every evaluated length reaches t. When the first evaluated
length already fails, the horizon is ``low - 1``: for a first bin starting at L + 1 (L the longest
training length), L, no generalisation past the training lengths. So a horizon lies in
[low - 1, high], and equals high when every length passes.

Over several evaluations held out by length (:func:`chained_horizon`: the length bins, and before
them the ``length_generalisation`` split where the first bin starts right after it) the horizon
starts from the longest training length L and runs on from one evaluation into the next only where
the next starts right after the lengths reached (no length left out between them) and the previous
passed all of its lengths: it never claims lengths that were not evaluated. So a first bin of
21–40 after training on 1–10, with 11–20 not in the chain, gives L = 10 whatever the bin's scores
(its own horizon, relative to its range, is reported with it). Of a single bin past the first
unseen length, a report states only whether it passes and, if not, its first failing length
(:func:`first_failing_length`), never its lowest length − 1 as if that length had been reached.

Every accuracy over n strings is stated with its binomial standard error sqrt(p (1 - p) / n)
(:func:`binomial_se`): a bin of 400 strings at p = 0.8 has 0.02, a length of 20 strings 0.09.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["DEFAULT_THRESHOLD", "horizon", "first_failing_length", "chained_horizon", "binomial_se"]

DEFAULT_THRESHOLD = 0.95
"""The accuracy a length must reach to count within the horizon, unless the task sets another."""


def horizon(accuracy_by_length: Mapping[int, float], threshold: float, low: int) -> int:
    """The generalisation horizon of one evaluation (see the module docstring).

    Args:
        accuracy_by_length: evaluated length -> accuracy; lengths without strings are left out.
        threshold: t, in (0, 1].
        low: the evaluation's lowest length (its range's, evaluated or not).

    Returns:
        The longest evaluated length n such that every evaluated length <= n has accuracy >= t;
        ``low - 1`` when the first evaluated length fails (or none is evaluated).
    """
    reached = low - 1
    for length in sorted(accuracy_by_length):
        if accuracy_by_length[length] < threshold:
            break
        reached = length
    return reached


def first_failing_length(accuracy_by_length: Mapping[int, float], threshold: float) -> int | None:
    """The shortest evaluated length below the threshold: what a split's own verdict states where
    its range does not start right after the training lengths (its :func:`horizon` would be its
    lowest length − 1 on a first failure, a length the model was never shown to reach).

    Args:
        accuracy_by_length: evaluated length -> accuracy; lengths without strings are left out.
        threshold: t, in (0, 1].

    Returns:
        The first length with accuracy < t; None when every evaluated length passes (or none is
        evaluated).
    """
    return next((n for n in sorted(accuracy_by_length) if accuracy_by_length[n] < threshold), None)


def chained_horizon(results: Sequence[Mapping[str, Any]], trained_up_to: int | None = None) -> int | None:
    """The horizon over consecutive evaluations held out by length (each with ``horizon`` and
    ``length_range`` = [low, high]), in order of their lows: the first one's horizon, carried into
    the next while one passed all its lengths and the next starts at its high + 1.

    Args:
        results: the evaluations (records without a horizon or range are left out).
        trained_up_to: L, the longest training length: where the first evaluation starts past
            L + 1, the lengths between were not evaluated and the horizon is L. None: no such check.

    Returns:
        The horizon; None without evaluations.
    """
    bins = sorted((r for r in results if "horizon" in r and "length_range" in r), key=lambda r: r["length_range"][0])
    if not bins:
        return None
    if trained_up_to is not None and int(bins[0]["length_range"][0]) > trained_up_to + 1:
        return trained_up_to
    reached = int(bins[0]["horizon"])
    for previous, following in zip(bins, bins[1:]):
        high = int(previous["length_range"][1])
        if reached != high or int(following["length_range"][0]) != high + 1:
            break
        reached = int(following["horizon"])
    return reached


def binomial_se(accuracy: float, n: int) -> float:
    """sqrt(p (1 - p) / n), the standard error of an accuracy p measured on n strings (nan for n = 0).

    For a score that is a share of tokens rather than right or wrong, an upper bound."""
    if n <= 0:
        return math.nan
    p = min(max(accuracy, 0.0), 1.0)
    return math.sqrt(p * (1.0 - p) / n)
