"""Counter languages: a^k b^k and a^k b^k c^k, k >= 1 (``anbn``, ``anbncn``).

One positive of each length that is a multiple of the number of letters (none of other lengths).
Next symbols of a prefix: the block count k is fixed by the a's; inside a later block the same
letter until it holds k, then the next letter, or END after the last. The paper's generator
(Bhattamishra, Ahuja & Goyal 2020, ``CounterLanguage``) draws k uniformly over the split's lengths.
Membership is checked by a regular expression and counting.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from attnlab.tasks.formal_base import END, Language

__all__ = ["ANBN", "ANBNCN", "is_anbn", "is_anbncn"]


def is_anbn(s: str) -> bool:
    match = re.fullmatch(r"(a+)(b+)", s)
    return match is not None and len(match[1]) == len(match[2])


def is_anbncn(s: str) -> bool:
    match = re.fullmatch(r"(a+)(b+)(c+)", s)
    return match is not None and len(match[1]) == len(match[2]) == len(match[3])


def _blocks_next(letters: str) -> Callable[[str], frozenset[str]]:
    """Next symbols of a prefix of a^k b^k (c^k): the block count k is fixed by the a's; inside
    block j > 0 the same letter until it holds k, then the next letter, or END after the last."""
    pattern = re.compile("".join(f"({letter}*)" for letter in letters))

    def next_symbols(prefix: str) -> frozenset[str]:
        match = pattern.fullmatch(prefix)
        if match is None:
            return frozenset()
        counts = [len(group) for group in match.groups()]
        k = counts[0]
        if k == 0:
            return frozenset(letters[0]) if not prefix else frozenset()
        j = max(i for i, count in enumerate(counts) if count > 0)  # the block being written
        if j == 0:
            return frozenset(letters[:2])  # more a's, or the first b
        if any(counts[i] != k for i in range(1, j)) or counts[j] > k:
            return frozenset()
        if counts[j] < k:
            return frozenset(letters[j])
        return frozenset(letters[j + 1]) if j + 1 < len(letters) else frozenset(END)

    return next_symbols


def _blocks_positive(letters: str) -> Callable[[random.Random, int], str | None]:
    def sample(rng: random.Random, n: int) -> str | None:
        if n % len(letters) or n == 0:
            return None
        return "".join(letter * (n // len(letters)) for letter in letters)

    return sample


def _blocks_grammar(letters: str) -> Callable[[random.Random, float, float, int, int], str | None]:
    """The paper's counter languages (``CounterLanguage.generate_sample``): the block count k is
    uniform over the k whose length k * |letters| lies in [low, high]; p and q play no part."""

    def draw(rng: random.Random, p: float, q: float, low: int, high: int) -> str | None:
        counts = range(-(-max(low, 1) // len(letters)), high // len(letters) + 1)
        if not counts:
            return None
        k = rng.choice(counts)
        return "".join(letter * k for letter in letters)

    return draw


ANBN = Language(
    "anbn",
    "ab",
    is_anbn,
    _blocks_positive("ab"),
    lambda n: int(n > 0 and n % 2 == 0),
    _blocks_next("ab"),
    _blocks_grammar("ab"),
)


ANBNCN = Language(
    "anbncn",
    "abc",
    is_anbncn,
    _blocks_positive("abc"),
    lambda n: int(n > 0 and n % 3 == 0),
    _blocks_next("abc"),
    _blocks_grammar("abc"),
)
