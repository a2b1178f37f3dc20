"""The Dyck languages, balanced and properly nested brackets: dyck1 ``( )``, dyck2 ``( ) [ ]``.

Positives of length n (n even): Catalan(n/2) shapes for dyck1, Catalan(n/2) 2^(n/2) for dyck2,
Catalan(k) = C(2k, k) / (k + 1). Drawn uniformly among shapes, opening at each step with the share
of the completions that open; or among the shapes of a nesting depth in [low, high]
(:func:`bracket_depth`); or from the probabilistic grammar S -> (S) | SS | ε of Bhattamishra, Ahuja
& Goyal (2020, §4), :func:`dyck_derivation`, with its closed forms (:func:`pcfg_expected_length`,
:func:`pcfg_length_variance`, :func:`pcfg_depth_cdf`). Membership is decided by rewriting (delete
matched pairs until none is left), deliberately unlike the generators' depth counting.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from functools import cache

from attnlab.tasks.formal_base import END, Language

__all__ = [
    "DYCK1",
    "DYCK2",
    "bracket_depth",
    "dyck_derivation",
    "is_dyck1",
    "is_dyck2",
    "pcfg_depth_cdf",
    "pcfg_expected_length",
    "pcfg_length_variance",
]


def _reduces_to_empty(s: str, pairs: tuple[str, ...]) -> bool:
    # Delete adjacent matched pairs until none is left: a string is a Dyck word iff this
    # rewriting ends at the empty string. Deliberately unlike the generator's depth counting.
    previous = None
    while s and s != previous:
        previous = s
        for pair in pairs:
            s = s.replace(pair, "")
    return s == ""


def is_dyck1(s: str) -> bool:
    return len(s) > 0 and set(s) <= set("()") and _reduces_to_empty(s, ("()",))


def is_dyck2(s: str) -> bool:
    return len(s) > 0 and set(s) <= set("()[]") and _reduces_to_empty(s, ("()", "[]"))


def _dyck_next(pairs: dict[str, str]) -> Callable[[str], frozenset[str]]:
    """Next symbols of a Dyck prefix: the last set of :func:`_dyck_prefixes_next`."""
    prefixes_next = _dyck_prefixes_next(pairs)
    return lambda prefix: prefixes_next(prefix)[-1]


def _dyck_prefixes_next(pairs: dict[str, str]) -> Callable[[str], list[frozenset[str]]]:
    """Next symbols of every prefix string[:t] of a Dyck string, t = 0..n, in one left-to-right
    scan: any opener; the closer of the innermost open bracket; END once every bracket is closed
    (and the prefix is not empty); nothing from the first closer that closes nothing open on."""
    openers = frozenset(pairs)
    after_closing_all = openers | {END}
    with_closer = {closer: openers | {closer} for closer in pairs.values()}

    def prefixes_next(string: str) -> list[frozenset[str]]:
        sets, stack = [openers], []
        for ch in string:
            if ch in pairs:
                stack.append(pairs[ch])
            elif stack and stack[-1] == ch:
                stack.pop()
            else:  # no continuation of this prefix, or of any longer one, is a member
                return sets + [frozenset()] * (len(string) + 1 - len(sets))
            sets.append(with_closer[stack[-1]] if stack else after_closing_all)
        return sets

    return prefixes_next


@cache
def _dyck_completions(steps: int, depth: int) -> int:
    """Number of bracket shapes of ``steps`` more symbols that close ``depth`` open brackets."""
    if depth < 0 or depth > steps:
        return 0
    if steps == 0:
        return 1
    return _dyck_completions(steps - 1, depth + 1) + _dyck_completions(steps - 1, depth - 1)


def _dyck_positive(kinds: str) -> Callable[[random.Random, int], str | None]:
    def sample(rng: random.Random, n: int) -> str | None:
        if n % 2 or n == 0:
            return None
        out, stack = [], []
        for step in range(n, 0, -1):
            # Open with the probability that keeps the shape uniform among all Dyck shapes.
            opens = _dyck_completions(step - 1, len(stack) + 1)
            if rng.random() * _dyck_completions(step, len(stack)) < opens:
                kind = rng.choice(kinds)
                stack.append(kind)
                out.append(kind)
            else:
                out.append(")]"["([".index(stack.pop())])
        return "".join(out)

    return sample


def bracket_depth(s: str) -> int:
    """The nesting depth of a bracket string: the most brackets open at once, max over prefixes of
    (openers - closers), at least 0. ``(()())`` -> 2, ``[()]()`` -> 2, ``)(`` -> 1. Defined for
    any bracket string, members or not, so a depth bin can hold negatives too."""
    depth = deepest = 0
    for ch in s:
        depth += 1 if ch in "([" else -1
        deepest = max(deepest, depth)
    return deepest


@cache
def _bounded_completions(steps: int, depth: int, cap: int, need: int) -> int:
    """Bracket shapes of ``steps`` more symbols that close ``depth`` open brackets, never with more
    than ``cap`` open, and with ``need`` open at some point (reached already when depth >= need)."""
    if depth < 0 or depth > cap or depth > steps:
        return 0
    need = 0 if depth >= need else need
    if steps == 0:
        return int(need == 0)
    return _bounded_completions(steps - 1, depth + 1, cap, need) + _bounded_completions(steps - 1, depth - 1, cap, need)


def _dyck_shapes_at_depth(n: int, low: int, high: int) -> int:
    """Dyck shapes of n symbols whose depth lies in [low, high]."""
    return _bounded_completions(n, 0, high, low) if n > 0 and n % 2 == 0 else 0


def _dyck_positive_at_depth(kinds: str) -> Callable[[random.Random, int, int, int], str | None]:
    """Sample uniformly among the Dyck words of n symbols with a depth in [low, high]: the shape
    step by step, opening with the share of the completions that open (as :func:`_dyck_positive`
    does, counting only shapes within the depths), each opener's kind uniform."""

    def sample(rng: random.Random, n: int, low: int, high: int) -> str | None:
        if _dyck_shapes_at_depth(n, low, high) == 0:
            return None
        out, stack, need = [], [], low
        for step in range(n, 0, -1):
            need = 0 if len(stack) >= need else need
            opens = _bounded_completions(step - 1, len(stack) + 1, high, need)
            if rng.random() * _bounded_completions(step, len(stack), high, need) < opens:
                kind = rng.choice(kinds)
                stack.append(kind)
                out.append(kind)
            else:
                out.append(")]"["([".index(stack.pop())])
        return "".join(out)

    return sample


# ---- the paper's generator (``task.sampler = "pcfg"``, Bhattamishra et al. 2020) ----------------


def dyck_derivation(kinds: str) -> Callable[[random.Random, float, float, float], str]:
    """A Dyck word drawn from the probabilistic grammar of Bhattamishra, Ahuja & Goyal (2020, §4):

        S -> (_i S )_i  with probability p (the kind i uniform),
        S -> S S        with probability q,
        S -> ε          with probability r = 1 - p - q.

    ``derive(rng, p, q, budget)``: as the authors' generator (Transformer-Formal-Languages,
    ``DyckLanguage.generate``) caps it, a node nested in d pairs counts 2d symbols against the
    budget: at 2d >= budget it derives ε without a draw, and a derivation longer than the budget
    becomes ε. ``budget = math.inf`` is the grammar itself.

    Closed forms of the grammar (no budget), with r = 1 - p - q and p + 2q < 1 (the branching
    process is subcritical: each S has on average p + 2q children S):

    * length L: L = 2 + L' with p, L' + L'' with q, 0 with r, the L's independent copies; so
      m = E[L] = p (2 + m) + 2 q m, i.e. **E[L] = 2p / (1 - p - 2q)**, and E[L²] = p (4 + 4m + E[L²])
      + q (2 E[L²] + 2 m²), i.e. E[L²] = (4p (1 + m) + 2q m²) / (1 - p - 2q).
    * depth D (the most pairs open at once): F_d = P(D <= d) solves F_d = r + p F_{d-1} + q F_d²
      (F_{-1} = 0), the least root F_d = (1 - sqrt(1 - 4q (r + p F_{d-1}))) / (2q) (F_d = r + p
      F_{d-1} when q = 0); E[D] = sum_{d >= 0} (1 - F_d) (:func:`pcfg_depth_cdf`).

    The paper's p = 1/2, q = 1/4 is the critical case p + 2q = 1: E[L] is infinite, so the budget
    (the longest length of the split) is what keeps strings finite there.

    The recursion, as the authors write it (each S draws u, then the kind of (S), then derives its
    children left to right; a word over the budget becomes ε after its children are derived, so
    which numbers are drawn does not depend on it)::

        def derive(opened):
            if opened >= budget: return ""
            u = rng.random()
            if u < p: kind = rng.choice(kinds); word = kind + derive(opened + 2) + closer[kind]
            elif u < p + q: word = derive(opened) + derive(opened)
            else: return ""
            return word if len(word) <= budget else ""

    runs here on an explicit stack (near the critical point a derivation has thousands of nodes,
    and a split draws hundreds of thousands of derivations), drawing the same numbers in the same
    order, the kind as ``rng.choice`` draws it (rejection over ``getrandbits``): the strings and
    the generator's state after them are the recursion's (tested against it).
    """
    closer = dict(zip("([", ")]"))
    count, width = len(kinds), len(kinds).bit_length()
    wrap, left, right = 0, 1, 2  # what an S on the stack waits for: its (S) inside, its left or right S

    def derive(rng: random.Random, p: float, q: float, budget: float, opened: int = 0) -> str:
        draw, bits = rng.random, rng.getrandbits
        stack: list[tuple[int, str, int]] = []  # (waits for, its kind or its left word, its depth)
        depth: int | None = opened  # the S to derive next; None while a derived word returns
        while True:
            if depth is not None:
                word = ""
                if depth < budget:
                    u = draw()
                    if u < p:
                        r = bits(width)
                        while r >= count:
                            r = bits(width)
                        stack.append((wrap, kinds[r], depth))
                        depth += 2
                        continue
                    if u < p + q:
                        stack.append((left, "", depth))
                        continue
                depth = None
            while stack:  # ``word`` returns to the S on top
                waits, held, at = stack.pop()
                if waits == left:
                    stack.append((right, word, at))
                    depth = at
                    break
                word = held + word + closer[held] if waits == wrap else held + word
                if len(word) > budget:
                    word = ""
            else:
                return word

    return derive


def pcfg_expected_length(p: float, q: float) -> float:
    """E[L] = 2p / (1 - p - 2q) of :func:`dyck_derivation`'s grammar (infinite when p + 2q >= 1)."""
    return 2 * p / (1 - p - 2 * q) if p + 2 * q < 1 else math.inf


def pcfg_length_variance(p: float, q: float) -> float:
    """Var L = E[L²] - E[L]² of the grammar (see :func:`dyck_derivation`), for p + 2q < 1."""
    m = pcfg_expected_length(p, q)
    second = (4 * p * (1 + m) + 2 * q * m * m) / (1 - p - 2 * q)
    return second - m * m


def pcfg_depth_cdf(p: float, q: float, depths: int) -> list[float]:
    """F_0 .. F_{depths-1}, F_d = P(depth <= d) of the grammar (see :func:`dyck_derivation`)."""
    r, cdf, previous = 1 - p - q, [], 0.0
    for _ in range(depths):
        c = r + p * previous
        previous = c if q == 0 else (1 - math.sqrt(1 - 4 * q * c)) / (2 * q)
        cdf.append(previous)
    return cdf


def _dyck_grammar(kinds: str) -> Callable[[random.Random, float, float, int, int], str | None]:
    """The paper's draw of a Dyck split with lengths in [low, high]: a derivation under the
    budget ``high``, rejected (None) when shorter than ``low``, as its ``generate_list`` does."""
    derive = dyck_derivation(kinds)

    def draw(rng: random.Random, p: float, q: float, low: int, high: int) -> str | None:
        word = derive(rng, p, q, high)
        return word if len(word) >= low else None

    return draw


def _catalan(k: int) -> int:
    return math.comb(2 * k, k) // (k + 1)


def _balanced_dyck1(n: int) -> int:
    """Non-members of length n with as many ( as ): C(n, n/2) - Catalan(n/2)."""
    return math.comb(n, n // 2) - _catalan(n // 2) if n > 0 and n % 2 == 0 else 0


def _balanced_dyck2(n: int) -> int:
    """Non-members of length n with as many ( as ) and as many [ as ]: the arrangements
    n! / (a! a! b! b!) summed over a + b = n/2, less the Dyck-2 words."""
    if n <= 0 or n % 2:
        return 0
    half = n // 2
    arrangements = sum(
        math.factorial(n) // (math.factorial(a) ** 2 * math.factorial(half - a) ** 2) for a in range(half + 1)
    )
    return arrangements - _catalan(half) * 2**half


DYCK1 = Language(
    "dyck1",
    "()",
    is_dyck1,
    _dyck_positive("("),
    lambda n: _catalan(n // 2) if n > 0 and n % 2 == 0 else 0,
    _dyck_next({"(": ")"}),
    _dyck_grammar("("),
    _balanced_dyck1,
    _dyck_shapes_at_depth,
    _dyck_positive_at_depth("("),
    _dyck_prefixes_next({"(": ")"}),
)


DYCK2 = Language(
    "dyck2",
    "()[]",
    is_dyck2,
    _dyck_positive("(["),
    lambda n: _catalan(n // 2) * 2 ** (n // 2) if n > 0 and n % 2 == 0 else 0,
    _dyck_next({"(": ")", "[": "]"}),
    _dyck_grammar("(["),
    _balanced_dyck2,
    lambda n, low, high: _dyck_shapes_at_depth(n, low, high) * 2 ** (n // 2),
    _dyck_positive_at_depth("(["),
    _dyck_prefixes_next({"(": ")", "[": "]"}),
)
