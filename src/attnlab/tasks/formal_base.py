"""What a formal language is to the recognition task (:mod:`attnlab.tasks.formal`): a :class:`Language`
(its alphabet, membership checker, samplers, counts and next-symbol sets), :data:`END`, and the
near-misses that negatives are drawn from.

The languages themselves are in one module per family: :mod:`attnlab.tasks.formal_parity`
(regular: parity), :mod:`attnlab.tasks.formal_dyck` (bracket languages: dyck1, dyck2) and
:mod:`attnlab.tasks.formal_counter` (counter languages: anbn, anbncn).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["END", "Language", "near_misses"]

END = "$"
"""Stands for the end symbol (EOS) in a next-symbol set: the prefix read so far is itself a member."""


@dataclass(frozen=True)
class Language:
    """A formal language: its alphabet, membership checker, samplers (uniform over shapes, and the
    paper's generator) and positive count."""

    name: str
    alphabet: str
    contains: Callable[[str], bool]
    sample_positive: Callable[[random.Random, int], str | None]
    count_positive: Callable[[int], int]
    next_symbols: Callable[[str], frozenset[str]]
    grammar: Callable[[random.Random, float, float, int, int], str | None]
    """The paper's generator (``task.sampler = "pcfg"``): ``grammar(rng, p, q, low, high)`` draws a
    member with a length in [low, high], or None (rejected; the caller draws again)."""
    count_balanced: Callable[[int], int] | None = None
    count_at_depth: Callable[[int, int, int], int] | None = None
    """Bracket languages: positives of length n with a depth in [low, high] (:func:`bracket_depth`)."""
    sample_at_depth: Callable[[random.Random, int, int, int], str | None] | None = None
    """Bracket languages: a uniform positive of length n with a depth in [low, high], or None."""
    prefixes_next: Callable[[str], list[frozenset[str]]] | None = None
    """Where one scan gives them: ``next_symbols(string[:t])`` for t = 0..n (see
    :meth:`next_symbols_of_prefixes`)."""

    def next_symbols_of_prefixes(self, string: str) -> list[frozenset[str]]:
        """``next_symbols(string[:t])`` for t = 0..n: one scan where the language has one
        (:attr:`prefixes_next`), else prefix by prefix."""
        if self.prefixes_next is not None:
            return self.prefixes_next(string)
        return [self.next_symbols(string[:t]) for t in range(len(string) + 1)]

    def positives(self, n: int) -> Iterator[str]:
        """All positives of length n, by brute force; only for the small counts it is used on."""
        if self.count_positive(n) == 0:
            return
        if self.count_positive(n) == 1:
            yield self.sample_positive(random.Random(0), n)  # the one string; the rng is unused
            return
        stack = [""]
        while stack:
            prefix = stack.pop()
            if len(prefix) == n:
                if self.contains(prefix):
                    yield prefix
                continue
            stack.extend(prefix + symbol for symbol in reversed(self.alphabet))

    @property
    def has_balanced_negatives(self) -> bool:
        """Whether the language draws balanced-count negatives (the Dyck languages)."""
        return self.count_balanced is not None

    @property
    def has_depth(self) -> bool:
        """Whether the language's strings have a nesting depth (the bracket languages)."""
        return self.count_at_depth is not None

    def near_miss_sources(self, n: int, count: Callable[[int], int] | None = None) -> dict[int, int]:
        """Base length -> an upper bound on the near-misses of length ``n`` it yields, from the
        positives ``count`` counts (default all of them).

        A change or a swap keeps a positive's length; a drop shortens it by one.
        """
        count = count or self.count_positive
        k, m = len(self.alphabet), n + 1
        return {
            n: count(n) * (n * (k - 1) + (n - 1)),  # changes and swaps
            m: count(m) * m,  # drops
        }

    def count_near_misses(self, n: int, count: Callable[[int], int] | None = None) -> int:
        """An upper bound on the non-members of length ``n`` one edit away from a positive (of those
        ``count`` counts)."""
        return min(sum(self.near_miss_sources(n, count).values()), len(self.alphabet) ** n - self.count_positive(n))


def near_misses(s: str, alphabet: str) -> list[str]:
    """Every string one edit away from ``s``: a symbol changed, adjacent symbols swapped, or dropped."""
    out = []
    for i, symbol in enumerate(s):
        out.extend(s[:i] + other + s[i + 1 :] for other in alphabet if other != symbol)
        if i + 1 < len(s) and s[i] != s[i + 1]:
            out.append(s[:i] + s[i + 1] + s[i] + s[i + 2 :])
        if len(s) > 1:
            out.append(s[:i] + s[i + 1 :])
    return out
