"""Parity, a regular language: binary strings with an even number of 1s.

``parity`` "1011" is not a member (three 1s). Positives of length n: 2^(n-1), drawn uniformly by
n - 1 free bits and a last bit that restores evenness. Next symbols of a prefix: both bits always,
END after an even number of 1s. The membership checker counts; the generator constructs.
"""

from __future__ import annotations

import random

from attnlab.tasks.formal_base import END, Language

__all__ = ["PARITY", "is_parity"]


def is_parity(s: str) -> bool:
    return len(s) > 0 and set(s) <= {"0", "1"} and s.count("1") % 2 == 0


def _parity_next(prefix: str) -> frozenset[str]:
    # Every binary prefix extends to a member (append a 1 or not): both bits may follow.
    if not set(prefix) <= {"0", "1"}:
        return frozenset()
    return frozenset("01") | ({END} if is_parity(prefix) else frozenset())


def _parity_positive(rng: random.Random, n: int) -> str | None:
    bits = [rng.choice("01") for _ in range(n - 1)]
    # The last bit restores evenness, which makes the draw uniform over the 2^(n-1) positives.
    bits.append("1" if bits.count("1") % 2 else "0")
    return "".join(bits)


def _parity_grammar(rng: random.Random, p: float, q: float, low: int, high: int) -> str | None:
    """The paper's parity (``ParityLanguage``): symbols 0 and 1 each with probability
    s = M / (2 (1 + M)), M = (low + high) // 2, until a stop (1 - 2s) or ``high`` symbols, so the
    length is geometric with mean about M; a string with an odd number of 1s gets a 1 appended
    (dropped when that makes it too long). Rejected (None) outside [low, high]; p and q play no part."""
    middle = (low + high) // 2
    keep = middle / (1 + middle)  # 2s: the chance of one more symbol
    bits = []
    while len(bits) < high and rng.random() < keep:
        bits.append(rng.choice("01"))
    word = "".join(bits)
    if word.count("1") % 2:
        word += "1"
    return word if low <= len(word) <= high else None


PARITY = Language(
    "parity",
    "01",
    is_parity,
    _parity_positive,
    lambda n: 2 ** (n - 1) if n > 0 else 0,
    _parity_next,
    _parity_grammar,
)
