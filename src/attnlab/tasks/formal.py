"""Language recognition: is a string in the formal language? (Hahn §3)

"Language recognition is the task of classifying input strings as belonging or not belonging to a
formal language ... a softmax probability vector is computed for this label from the last
activation y_n^(L), obtained after reading the end-of-sequence symbol" (Hahn §3). So every example
is the string followed by EOS, and the label is 1 (in the language) or 0 (not).

Token encoding (all languages): PAD=0, BOS=1 (unused here), EOS=2, then the alphabet in order
from id 3. ``parity`` "1011" -> [4, 3, 4, 4, 2] with label 0 (three 1s).

=========  ========  ================================  =========================================
language   alphabet  in the language                   distinct positives of length n
=========  ========  ================================  =========================================
parity     0 1       an even number of 1s              2^(n-1)
dyck1      ( )       balanced parentheses              Catalan(n/2) for even n, else 0
dyck2      ( ) [ ]   balanced, properly nested, 2 kinds Catalan(n/2) * 2^(n/2) for even n
anbn       a b       a^k b^k, k >= 1                   1 if n is even, else 0
anbncn     a b c     a^k b^k c^k, k >= 1               1 if n is a multiple of 3, else 0
=========  ========  ================================  =========================================

Strings of length n over an alphabet of size |Σ| number |Σ|^n. Classes are balanced: half of
every split is positive. Lengths are drawn uniformly, except that a length is drawn in proportion
to how many distinct strings of that class and length the split can hold while that number is below
the split's draws: so the one or two shortest strings never make up a large part of a split by
repetition. Negatives are near-misses: a positive with one symbol changed, two
adjacent symbols swapped, or one symbol dropped, kept only if the result is *not* in the
language, so that a classifier cannot tell them apart by surface statistics alone.

For the Dyck languages, at least :data:`BALANCED_SHARE` (half) of every split's negatives keep every
bracket count balanced and are wrong only in their order: a positive with two of its symbols
exchanged (``)(`` where ``()`` was, so that a prefix goes below zero, or crossed kinds ``([)]``).
Without them almost every near-miss changes a count, and a classifier that only counts brackets
(no positions at all) scores near 1. Each split reports its distinct strings and positives and the
accuracy of such a shortcut (:meth:`RecognitionTask.split_report`, :data:`COUNTING_BASELINES`);
a held-out split with fewer than :data:`MIN_DISTINCT_STRINGS` distinct strings (or, classifying,
:data:`MIN_DISTINCT_POSITIVES` distinct positives) is warned about.

Two formulations (``task.formulation``):

* ``classify`` (the default): the membership label above, read at EOS by an encoder classifier.
* ``next_char`` (Bhattamishra, Ahuja & Goyal 2020, "On the Ability and Limitations of Transformers
  to Recognize Formal Languages"): every example is a *member*; a causal decoder reads
  BOS + the string and, at each position t (having read the prefix w[:t]), predicts the set of
  symbols that may follow it in the language, EOS included when w[:t] is itself a member
  (:attr:`Language.next_symbols`). Multi-label: one sigmoid per symbol (see
  :mod:`attnlab.evaluation.objectives`); a string counts as right only when every position's set is.
  dyck1 after ``(()``: {``(``, ``)``}; after ``()``: {``(``, EOS}. parity: both bits always, EOS
  after an even number of 1s (the only signal parity gives).

Length bins (``task.eval_lengths = [[13, 24], [25, 48]]``): each bin is a split of its own,
``length_13_24``, drawn like ``length_generalisation`` (which stays (L, 2L]). A split held out by
length draws each of its lengths equally often, so that every length the language has is evaluated
(the evaluation reports the others as absent).

Depth bins (``task.eval_depths = [[1, 9], [10, 20]]``, dyck1 and dyck2): a Dyck word's length and
nesting depth grow together (the deepest of 2000 training strings of length <= 20 may be 9 while most
strings of length 81–120 go deeper than 10), so a length bin alone cannot tell which one a model
fails on. Each depth bin is a split of its own, ``depth_1_9``, of strings whose depth
(:func:`bracket_depth`) lies in the bin, at the lengths ``task.eval_depth_lengths`` (default: those of
the length bins); the depth range of every split's members, the training split's included, is in its
report (``depth_min``, ``depth_max``).

The paper's protocol (Bhattamishra, Ahuja & Goyal 2020, from its authors' code,
Transformer-Formal-Languages): ``task.sampler = "pcfg"`` draws positives with the paper's
generator (for Dyck the grammar S -> (S) | SS | ε with ``task.p``, ``task.q``, see
:func:`dyck_derivation` for its closed forms; the counter languages a block count uniform over
the split's), and ``task.distinct = true`` keeps every split free of repeats. ``task.fresh_examples``
trains on a new batch from the training split's distribution at every step (Delétang et al. 2023).

Membership is decided by checkers written independently of the generators (counting and
rewriting rather than construction), so tests can hold one against the other.
"""

from __future__ import annotations

import math
import random
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cache, cached_property
from typing import Any

from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.tasks.base import (
    Example,
    Vocab,
    VocabIds,
    check_depth_bins,
    check_horizon_threshold,
    check_length_bins,
    check_sizes,
    length_bin_name,
    split_of,
    split_share,
    split_statistics,
    spread_lengths,
    weigh_lengths,
)

__all__ = [
    "END",
    "FORMULATIONS",
    "LANGUAGES",
    "Language",
    "RecognitionTask",
    "SAMPLERS",
    "baseline_accuracy",
    "check_grammar",
    "dyck_derivation",
    "pcfg_depth_cdf",
    "pcfg_expected_length",
    "pcfg_length_variance",
    "bracket_depth",
    "check_length_bins",
    "length_bin_name",
    "near_misses",
]

SMALL_LANGUAGE = 256
"""Up to this many positives of length <= L, positives are dealt to the splits, not hashed."""

MAX_TRIES_PER_EXAMPLE = 2000


# ---- membership checkers: independent of the generators -----------------------------------------


def is_parity(s: str) -> bool:
    return len(s) > 0 and set(s) <= {"0", "1"} and s.count("1") % 2 == 0


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


def is_anbn(s: str) -> bool:
    match = re.fullmatch(r"(a+)(b+)", s)
    return match is not None and len(match[1]) == len(match[2])


def is_anbncn(s: str) -> bool:
    match = re.fullmatch(r"(a+)(b+)(c+)", s)
    return match is not None and len(match[1]) == len(match[2]) == len(match[3])


# ---- next-symbol sets (the next_char formulation) -----------------------------------------------

END = "$"
"""Stands for the end symbol (EOS) in a next-symbol set: the prefix read so far is itself a member."""


def _parity_next(prefix: str) -> frozenset[str]:
    # Every binary prefix extends to a member (append a 1 or not): both bits may follow.
    if not set(prefix) <= {"0", "1"}:
        return frozenset()
    return frozenset("01") | ({END} if is_parity(prefix) else frozenset())


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


# ---- generators ---------------------------------------------------------------------------------


def _parity_positive(rng: random.Random, n: int) -> str | None:
    bits = [rng.choice("01") for _ in range(n - 1)]
    # The last bit restores evenness, which makes the draw uniform over the 2^(n-1) positives.
    bits.append("1" if bits.count("1") % 2 else "0")
    return "".join(bits)


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


def _blocks_positive(letters: str) -> Callable[[random.Random, int], str | None]:
    def sample(rng: random.Random, n: int) -> str | None:
        if n % len(letters) or n == 0:
            return None
        return "".join(letter * (n // len(letters)) for letter in letters)

    return sample


# ---- the paper's generators (``task.sampler = "pcfg"``, Bhattamishra et al. 2020) ----------------


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


def _catalan(k: int) -> int:
    return math.comb(2 * k, k) // (k + 1)


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


LANGUAGES: dict[str, Language] = {
    "parity": Language(
        "parity",
        "01",
        is_parity,
        _parity_positive,
        lambda n: 2 ** (n - 1) if n > 0 else 0,
        _parity_next,
        _parity_grammar,
    ),
    "dyck1": Language(
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
    ),
    "dyck2": Language(
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
    ),
    "anbn": Language(
        "anbn",
        "ab",
        is_anbn,
        _blocks_positive("ab"),
        lambda n: int(n > 0 and n % 2 == 0),
        _blocks_next("ab"),
        _blocks_grammar("ab"),
    ),
    "anbncn": Language(
        "anbncn",
        "abc",
        is_anbncn,
        _blocks_positive("abc"),
        lambda n: int(n > 0 and n % 3 == 0),
        _blocks_next("abc"),
        _blocks_grammar("abc"),
    ),
}
"""Registry: language name -> :class:`Language`."""


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


FORMULATIONS = ("classify", "next_char")
"""``classify``: membership, the label read at EOS (Hahn §3). ``next_char``: the set of symbols that
may follow each prefix (Bhattamishra, Ahuja & Goyal 2020)."""

BALANCED_SHARE = 0.5
"""The share of a Dyck split's negatives that are balanced-count transpositions (rounded up)."""

MIN_DISTINCT_STRINGS = 100
"""A held-out split with fewer distinct strings than this is warned about: its accuracy is a mean
over so few strings that its standard error can exceed 0.5 / sqrt(100) = 0.05."""

MIN_DISTINCT_POSITIVES = 25
"""... and so is one with fewer distinct positives (``classify``): the accuracy on its positive half
is a mean over fewer strings than this, with a standard error that can exceed 0.5 / sqrt(25) = 0.1."""


def _exchanges(s: str) -> Iterator[str]:
    """Every string made from ``s`` by exchanging two different symbols (any distance apart)."""
    for i in range(len(s)):
        for j in range(i + 1, len(s)):
            if s[i] != s[j]:
                yield s[:i] + s[j] + s[i + 1 : j] + s[i] + s[j + 1 :]


@dataclass(frozen=True)
class RecognitionTask(VocabIds):
    """Recognise one formal language; see the module docstring for encodings and counts.

    Attributes:
        language: a key of :data:`LANGUAGES`.
        max_train_length: L. train/valid/test strings have 1..L symbols; the
            length-generalisation split has L+1..2L.
        train_size, valid_size, test_size, length_generalisation_size: examples per split
            (half positive with ``classify``). Within a split a string may repeat when the
            language is small; across train, valid and test never. Each length bin of
            ``eval_lengths`` draws ``length_generalisation_size`` examples.
        seed: the seed of every draw and of the split assignment.
        formulation: ``classify`` (membership, label at EOS) or ``next_char`` (the set of
            symbols that may follow each prefix, on positive strings only); see the module docstring.
        eval_lengths: extra held-out splits by length, ``[[low, high], ...]``, inclusive, ordered,
            disjoint, every low above L; bin [low, high] is the split ``length_<low>_<high>``.
            The (L, 2L] ``length_generalisation`` split stays, and may overlap a bin.
        sampler: how positives are drawn: ``uniform`` (a length uniform as above, then a shape
            uniform among that length's members) or ``pcfg`` (the generator of Bhattamishra et
            al. 2020, :attr:`Language.grammar`: for Dyck the grammar of :func:`dyck_derivation`
            with ``p`` and ``q``, capped at the split's longest length and rejected below its
            shortest; for anbn, anbncn a block count uniform over the split's; for parity a
            geometric length). Negatives (``classify``) are near-misses of uniform positives either way,
            and the depth bins of ``eval_depths`` are drawn by depth, uniformly, under either sampler.
        p, q: the Dyck grammar's S -> (S) and S -> SS probabilities (the paper: 0.5, 0.25); 0 < p,
            0 <= q, p + q < 1. Used by ``sampler = "pcfg"`` for dyck1 and dyck2 only.
        distinct: no split holds a string twice (the paper's sets; train, valid and test never
            share one either way). A split the language cannot fill with distinct strings is an error.
        fresh_examples: train on examples drawn afresh for every batch (Delétang et al. 2023),
            from the training split's distribution (:meth:`fresh_train`), rather than on the fixed
            ``train_size`` examples; those still serve the checks and the training-fit report.
            The (L, 2L] ``length_generalisation`` split stays, and may overlap a bin. Every split held
            out by length draws each of its lengths equally often (:func:`spread_lengths`), so every
            length the language has is evaluated.
        eval_depths: held-out splits by nesting depth (:func:`bracket_depth`), bracket languages
            only: ``[[low, high], ...]``, inclusive, ordered, disjoint, every low >= 1; bin [low, high]
            is the split ``depth_<low>_<high>``, of ``length_generalisation_size`` strings whose depth
            lies in the bin (positives uniform among such words, negatives near-misses of them kept
            when their depth lies in the bin too), lengths from ``eval_depth_lengths``.
        eval_depth_lengths: ``[low, high]``, the lengths the depth bins draw from, above L; default
            from the first ``eval_lengths`` bin's low to the last one's high, or (L, 2L] without them.
        horizon_threshold: the accuracy a length must reach to count within the generalisation
            horizon (:func:`attnlab.evaluation.horizon.horizon`), in (0, 1].
    """

    language: str = "parity"
    max_train_length: int = 16
    train_size: int = 2000
    valid_size: int = 200
    test_size: int = 200
    length_generalisation_size: int = 200
    seed: int = 0
    formulation: str = "classify"
    eval_lengths: list[list[int]] = field(default_factory=list)
    sampler: str = "uniform"
    p: float = 0.5
    q: float = 0.25
    distinct: bool = False
    fresh_examples: bool = False
    eval_depths: list[list[int]] = field(default_factory=list)
    eval_depth_lengths: list[int] = field(default_factory=list)
    horizon_threshold: float = 0.95

    kind = "recognition"
    """``recognition`` (the class's, and ``classify``'s) or ``next_char``: what the model outputs."""

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ConfigError(f"language: unknown language {self.language!r}; choose one of {', '.join(LANGUAGES)}")
        if self.max_train_length < 1:
            raise ConfigError(f"max_train_length: must be >= 1, got {self.max_train_length}")
        if self.formulation not in FORMULATIONS:
            raise ConfigError(f"formulation: unknown {self.formulation!r}; choose one of {', '.join(FORMULATIONS)}")
        check_sizes(
            train_size=self.train_size,
            valid_size=self.valid_size,
            test_size=self.test_size,
            length_generalisation_size=self.length_generalisation_size,
        )
        check_length_bins(self.eval_lengths, self.max_train_length)
        check_grammar(self.sampler, self.p, self.q)
        check_horizon_threshold(self.horizon_threshold)
        self._check_depth_bins()
        if self.formulation == "next_char":
            object.__setattr__(self, "kind", "next_char")

    def _check_depth_bins(self) -> None:
        """``eval_depths``: bins of a bracket language, each holding strings at its lengths;
        ``eval_depth_lengths``: a [low, high] pair above L, only with depth bins."""
        if self.eval_depth_lengths and not self.eval_depths:
            raise ConfigError("eval_depth_lengths: set without eval_depths; it gives the depth bins' lengths")
        if not self.eval_depths:
            return
        if not self.lang.has_depth:
            bracket = ", ".join(name for name, lang in LANGUAGES.items() if lang.has_depth)
            raise ConfigError(f"eval_depths: {self.language} has no nesting depth; only {bracket} take depth bins")
        check_depth_bins(self.eval_depths)
        pair = self.eval_depth_lengths
        if pair:
            ints = len(pair) == 2 and all(isinstance(v, int) and not isinstance(v, bool) for v in pair)
            if not ints or not self.max_train_length < pair[0] <= pair[1]:
                raise ConfigError(
                    f"eval_depth_lengths: expected [low, high] with {self.max_train_length} (max_train_length) "
                    f"< low <= high, got {pair!r}"
                )
        lengths = self.depth_bin_lengths()
        for index, (low, high) in enumerate(self.eval_depths):
            if not any(self.lang.count_at_depth(n, low, high) for n in lengths):  # type: ignore[misc]
                raise ConfigError(
                    f"eval_depths: bin {index + 1} [{low}, {high}]: {self.language} has no string of such depth "
                    f"with a length in [{lengths.start}, {lengths.stop - 1}] (depth d needs 2d symbols)"
                )

    def depth_bin_lengths(self) -> range:
        """The lengths the depth bins draw from: ``eval_depth_lengths``, else the span of ``eval_lengths``,
        else (L, 2L]."""
        if self.eval_depth_lengths:
            return range(self.eval_depth_lengths[0], self.eval_depth_lengths[1] + 1)
        if self.eval_lengths:
            return range(self.eval_lengths[0][0], self.eval_lengths[-1][1] + 1)
        return range(self.max_train_length + 1, 2 * self.max_train_length + 1)

    # ---- vocabulary ---------------------------------------------------------------------------

    @property
    def lang(self) -> Language:
        return LANGUAGES[self.language]

    @property
    def vocab(self) -> Vocab:
        return Vocab.of(self.lang.alphabet)

    def num_distinct(self, length: int) -> int:
        """Distinct strings of ``length`` symbols: |Σ|^length (positives: :meth:`num_positive`)."""
        return len(self.lang.alphabet) ** length

    def num_positive(self, length: int) -> int:
        return self.lang.count_positive(length)

    def encode(self, string: str, label: int) -> Example:
        return Example(source=self.vocab.encode(string) + (self.eos_id,), label=label, length=len(string))

    def symbol_mask(self, symbols: frozenset[str]) -> int:
        """A next-symbol set as a bit mask over token ids: bit ``eos_id`` for :data:`END`, bit
        ``id(c)`` for a symbol c."""
        ids = self.vocab.encode(tuple(sorted(symbols - {END})))
        return sum(1 << i for i in ids) | ((1 << self.eos_id) if END in symbols else 0)

    def encode_next_char(self, string: str) -> Example:
        """A ``next_char`` example of a member ``string`` of n symbols.

        The decoder reads BOS + string (n + 1 positions, see :func:`attnlab.tasks.batching.collate`);
        position t has read the prefix string[:t] and its target is that prefix's next-symbol set
        (:attr:`Language.next_symbols`) as a mask over token ids (:meth:`symbol_mask`).
        """
        sets = self.lang.next_symbols_of_prefixes(string)
        mask_of = {symbols: self.symbol_mask(symbols) for symbols in set(sets)}  # a few distinct sets
        masks = tuple(mask_of[symbols] for symbols in sets)
        return Example(source=(), target=self.vocab.encode(string), label=1, length=len(string), next_symbols=masks)

    # ---- splits -------------------------------------------------------------------------------

    def split(self, name: str) -> list[Example]:
        """The examples of split ``name`` in a seeded random order.

        ``classify``: half positive; for the Dyck languages at least :data:`BALANCED_SHARE` of the
        negatives have balanced bracket counts (:meth:`_balanced_sampler`). ``next_char``: positive
        strings only, as Bhattamishra et al. train and test. With ``distinct``, no string twice.
        A split is drawn once per task object (the same seed gives the same examples anyway):
        every evaluation of a run scores the one it drew first.
        """
        self.check_split(name)
        if name not in self._drawn:
            size = self.split_size(name)
            if self.distinct:
                self._check_distinct(name, size)
            rng = random.Random(f"{self.seed}:{self.language}:{name}")
            self._drawn[name] = self._examples(name, size, rng, seen=set() if self.distinct else None)
        return list(self._drawn[name])

    @cached_property
    def _drawn(self) -> dict[str, list[Example]]:
        """Split name -> its examples, once drawn (:meth:`split`)."""
        return {}

    def fresh_train(self, rng: random.Random, size: int) -> list[Example]:
        """``size`` training examples drawn from ``rng`` as the train split draws its own (same
        lengths, same shares, only strings the train split owns): one batch of ``fresh_examples``."""
        return self._examples("train", size, rng, seen=None)

    def _examples(self, name: str, size: int, rng: random.Random, seen: set[str] | None) -> list[Example]:
        """``size`` examples of split ``name`` from ``rng``; with ``seen``, none whose string is in it
        (each drawn string is added)."""
        if self.formulation == "next_char":
            positives = _once(self._positive_sampler(name, draws=size), seen, self._too_few(name, size))
            return [self.encode_next_char(positives(rng)) for _ in range(size)]
        negatives_wanted = size - size // 2
        balanced = math.ceil(BALANCED_SHARE * negatives_wanted) if self.lang.has_balanced_negatives else 0
        too_few = self._too_few(name, size)
        positives = _once(self._positive_sampler(name, draws=size // 2), seen, too_few)
        examples = [self.encode(positives(rng), 1) for _ in range(size // 2)]
        if negatives_wanted - balanced:
            negatives = _once(self._negative_sampler(name, draws=negatives_wanted - balanced), seen, too_few)
            examples += [self.encode(negatives(rng), 0) for _ in range(negatives_wanted - balanced)]
        if balanced:
            swapped = _once(self._balanced_sampler(name, draws=balanced), seen, too_few)
            examples += [self.encode(swapped(rng), 0) for _ in range(balanced)]
        rng.shuffle(examples)
        return examples

    def _size_key(self, name: str) -> str:
        return "length_generalisation_size" if name in self.length_bins else f"{name}_size"

    def _too_few(self, name: str, size: int) -> str:
        lengths = self.lengths(name)
        return (
            f"task.{self._size_key(name)}: {self.language} has too few distinct strings of lengths "
            f"{lengths.start}..{lengths.stop - 1} for {size} {name} examples without repeats (task.distinct = true); "
            f"lower {self._size_key(name)}, widen the lengths, or set distinct = false"
        )

    def _check_distinct(self, name: str, size: int) -> None:
        """Refuse at once a split that needs more distinct members than the language has at its
        lengths (its share of them, for train, valid and test); :func:`_once` catches the rest."""
        wanted = size if self.formulation == "next_char" else size // 2
        share = split_share(self.share_name(name))
        members = sum(self.lang.count_positive(n) for n in self.lengths(name))
        if wanted > members * share:
            raise ConfigError(
                f"{self._too_few(name, size)} ({members} members, about {int(members * share)} of them in {name})"
            )

    def _owns(self, name: str, string: str) -> bool:
        if name in self.depth_bins:
            low, high = self.depth_bins[name]
            return low <= bracket_depth(string) <= high
        if self.held_out_by_length(name):
            return True
        dealt = self._dealt_balanced.get(string) or self._dealt_members.get(string)
        return (dealt or split_of(self.seed, string)) == name

    @cached_property
    def _dealt_members(self) -> dict[str, str]:
        """Positives -> the split dealt each one, when the language has few of length <= L
        (:meth:`_dealt_positives`); empty otherwise."""
        lengths = [n for n in self.lengths("train") if self.lang.count_positive(n) > 0]
        if sum(self.lang.count_positive(n) for n in lengths) > SMALL_LANGUAGE:
            return {}
        return {string: name for name, strings in self._dealt_positives(lengths).items() for string in strings}

    @cached_property
    def _dealt_balanced(self) -> dict[str, str]:
        """Balanced-count Dyck negatives -> the split dealt each one, when the language has few
        (at most :data:`SMALL_LANGUAGE` of length <= L): hashing could leave valid or test without
        any, as with few positives. A dealt string belongs to its split whichever sampler draws
        it (a near-miss can be one too), so no string is in two splits. Empty otherwise."""
        if not self.lang.has_balanced_negatives:
            return {}
        lengths = self.lengths("train")
        if sum(self.lang.count_balanced(n) for n in lengths) > SMALL_LANGUAGE:  # type: ignore[misc]
            return {}
        pool = sorted({swapped for n in lengths for base in self.lang.positives(n) for swapped in _exchanges(base)
                       if not self.lang.contains(swapped)})  # fmt: skip
        dealt = self._deal(pool, what="balanced-count negatives", salt="deal-balanced")
        return {string: name for name, strings in dealt.items() for string in strings}

    def _bases(self, name: str) -> tuple[Callable[[int], int], Callable[[random.Random, int], str | None]]:
        """How many positives of each length split ``name`` builds on, and a sampler of them: every
        positive, or in a depth bin those whose depth lies in the bin."""
        if name not in self.depth_bins:
            return self.lang.count_positive, self.lang.sample_positive
        low, high = self.depth_bins[name]
        count, sample = self.lang.count_at_depth, self.lang.sample_at_depth
        return lambda n: count(n, low, high), lambda rng, n: sample(rng, n, low, high)  # type: ignore[misc]

    def _per_example(
        self, name: str, lengths: list[int], weights: list[float], draws: int,
        candidate: Callable[[random.Random, int], str | None],
    ) -> Callable[[random.Random], str]:  # fmt: skip
        """A sampler of ``draws`` strings of split ``name`` from ``candidate`` (a string of length n,
        or None). In training lengths a fresh weighted length per try (a short length may own no
        string of the split); held out by length, each example's length fixed by :func:`spread_lengths`."""
        if not self.held_out_by_length(name):
            return lambda rng: self._draw(rng, lambda r: candidate(r, r.choices(lengths, weights)[0]), name)
        order = iter(spread_lengths(lengths, draws, random.Random(f"{self.seed}:{self.language}:{name}:lengths")))

        def sample(rng: random.Random) -> str:
            n = next(order)
            return self._draw(rng, lambda r: candidate(r, n), name)

        return sample

    def _positive_sampler(self, name: str, draws: int) -> Callable[[random.Random], str]:
        count, sample = self._bases(name)
        counts = {n: count(n) for n in self.lengths(name)}
        lengths, weights = weigh_lengths(self.share_name(name), counts, draws)
        if not lengths:
            raise ConfigError(
                f"{'eval_lengths' if name in self.length_bins else 'max_train_length'}: {self.language} has no "
                f"string with a length in [{self.lengths(name).start}, {self.lengths(name).stop - 1}]"
                + ("" if name in self.length_bins else "; raise max_train_length")
            )
        if self.sampler == "pcfg" and name not in self.depth_bins:  # a depth bin is drawn by depth, uniformly
            low, high = self.lengths(name).start, self.lengths(name).stop - 1
            return lambda rng: self._draw(rng, lambda r: self.lang.grammar(r, self.p, self.q, low, high), name)
        if not self.held_out_by_length(name) and sum(counts.values()) <= SMALL_LANGUAGE:
            pool = self._dealt_positives(lengths)[name]
            return lambda rng: rng.choice(pool)
        return self._per_example(name, lengths, weights, draws, sample)

    def _dealt_positives(self, lengths: list[int]) -> dict[str, list[str]]:
        # Few positives: hashing could leave valid or test without any. Deal them instead.
        return self._deal([s for n in lengths for s in self.lang.positives(n)], what="strings", salt="deal")

    def _deal(self, pool: list[str], *, what: str, salt: str) -> dict[str, list[str]]:
        """Split name -> its share of ``pool`` (changed in place), by a seeded shuffle, 80/10/10
        with at least one each. Still a partition: no string in two splits."""
        if len(pool) < 3:
            raise ConfigError(
                f"max_train_length: {self.language} has only {len(pool)} {what} of length <= "
                f"{self.max_train_length}, too few for train, valid and test; raise max_train_length"
            )
        random.Random(f"{self.seed}:{self.language}:{salt}").shuffle(pool)
        held = max(1, round(0.1 * len(pool)))
        return {"test": pool[:held], "valid": pool[held : 2 * held], "train": pool[2 * held :]}

    def _negative_sampler(self, name: str, draws: int) -> Callable[[random.Random], str]:
        count, sample = self._bases(name)
        counts = {n: self.lang.count_near_misses(n, count) for n in self.lengths(name)}
        lengths, weights = weigh_lengths(self.share_name(name), counts, draws)

        def candidate(rng: random.Random, n: int) -> str | None:
            sources = {m: bound for m, bound in self.lang.near_miss_sources(n, count).items() if bound > 0}
            base = sample(rng, rng.choices(list(sources), list(sources.values()))[0])
            if base is None:
                return None
            misses = [s for s in near_misses(base, self.lang.alphabet) if len(s) == n and not self.lang.contains(s)]
            return rng.choice(misses) if misses else None

        return self._per_example(name, lengths, weights, draws, candidate)

    def _balanced_sampler(self, name: str, draws: int) -> Callable[[random.Random], str]:
        """Dyck negatives that no count solves: a positive with two of its symbols exchanged (any
        distance apart), kept only when the result is not a member. An exchange keeps every
        bracket count, so the string is balanced and wrong only in its order: a closer comes
        before its opener (a prefix goes below zero) or, in Dyck-2, two kinds cross, ``([)]``."""
        dealt = [string for string, owner in self._dealt_balanced.items() if owner == name]
        if dealt and not self.held_out_by_length(name):
            return lambda rng: rng.choice(dealt)
        count, sample = self._bases(name)
        if name in self.depth_bins:  # exchanges of the bin's positives: at most as many as those
            counts = {n: min(count(n), self.lang.count_balanced(n)) for n in self.lengths(name)}  # type: ignore[misc]
        else:
            counts = {n: self.lang.count_balanced(n) for n in self.lengths(name)}  # type: ignore[misc]
        lengths, weights = weigh_lengths(self.share_name(name), counts, draws)

        def candidate(rng: random.Random, n: int) -> str | None:
            base = sample(rng, n)
            if base is None:
                return None
            i, j = sorted(rng.sample(range(len(base)), 2))
            if base[i] == base[j]:
                return None
            swapped = base[:i] + base[j] + base[i + 1 : j] + base[i] + base[j + 1 :]
            return None if self.lang.contains(swapped) else swapped

        return self._per_example(name, lengths, weights, draws, candidate)

    def _draw(self, rng: random.Random, candidate: Callable[[random.Random], str | None], name: str) -> str:
        for _ in range(MAX_TRIES_PER_EXAMPLE):
            s = candidate(rng)
            if s is not None and self._owns(name, s):
                return s
        raise ConfigError(
            f"{self.language}: could not draw a {name} string in {MAX_TRIES_PER_EXAMPLE} tries; "
            "the language has too few strings of these lengths, raise max_train_length"
        )

    # ---- what a split holds, and what a shortcut scores on it ---------------------------------

    def _warn_if_small(self, name: str, report: dict[str, Any]) -> None:
        reason = _small_split_rule(name, report, classify=self.formulation == "classify")
        if reason is not None:
            hint = "eval_lengths' bins" if self.held_out_by_length(name) else "max_train_length"
            hint = "eval_depths' bins" if name in self.depth_bins else hint
            warnings.warn(
                f"the {name} split holds {reason}: its accuracy is a mean over few strings; raise {hint} "
                "or the split's size",
                AttnlabWarning,
                stacklevel=3,
            )

    def string_of(self, example: Example) -> str:
        """The symbols of an example of this task (without EOS)."""
        ids = example.target if example.source == () else example.source[:-1]
        return "".join(self.vocab.tokens[i] for i in ids or ())

    def split_report(self, name: str, examples: Sequence[Example]) -> dict[str, Any]:
        """Split statistics and the shortcut baseline of split ``name`` (its ``examples``).

        Keys: ``distinct_strings``, ``positives``, ``distinct_positives`` (:func:`split_statistics`),
        for the bracket languages ``depth_min`` and ``depth_max`` (the depths of the split's members,
        :func:`bracket_depth`), and for ``classify`` ``baseline`` (its name), ``baseline_accuracy`` and
        ``majority_accuracy`` (:func:`baseline_accuracy`). A held-out split with fewer than
        :data:`MIN_DISTINCT_STRINGS` distinct strings, or (``classify``) fewer than
        :data:`MIN_DISTINCT_POSITIVES` distinct positives, is warned about (:class:`AttnlabWarning`).
        """
        report: dict[str, Any] = dict(split_statistics(examples))
        report.pop("examples")
        if self.lang.has_depth:  # the nesting depths of the split's members
            depths = [bracket_depth(self.string_of(e)) for e in examples if e.label == 1]
            if depths:
                report.update(depth_min=min(depths), depth_max=max(depths))
        if name != "train" and examples:  # training accuracy is not the reported one
            self._warn_if_small(name, report)
        if self.formulation == "classify":
            strings = [self.string_of(e) for e in examples]
            labels = [int(e.label or 0) for e in examples]
            # The training split holds train_size // 2 positives and the rest negatives.
            train_labels = [1] * (self.train_size // 2) + [0] * (self.train_size - self.train_size // 2)
            report.update(baseline_accuracy(self.language, strings, labels, majority_label(train_labels)))
        return report


SAMPLERS = ("uniform", "pcfg")
"""``task.sampler``: ``uniform`` (a length, then a shape uniform among its members) or ``pcfg``
(the generator of Bhattamishra et al. 2020, :attr:`Language.grammar`)."""


def check_grammar(sampler: str, p: float, q: float) -> None:
    """Refuse an unknown ``sampler``, and grammar probabilities outside 0 < p, 0 <= q, p + q < 1.

    Raises:
        ConfigError: one line naming ``sampler``, ``p`` or ``q``.
    """
    if sampler not in SAMPLERS:
        raise ConfigError(f"sampler: unknown {sampler!r}; choose one of {', '.join(SAMPLERS)}")
    if not p > 0:
        raise ConfigError(f"p: the probability of S -> (S) must be > 0, got {p}")
    if not q >= 0:
        raise ConfigError(f"q: the probability of S -> SS must be >= 0, got {q}")
    if not p + q < 1:
        raise ConfigError(f"q: p + q must be < 1 (S -> ε takes the rest), got p + q = {p + q}")


MAX_REPEATS = 1000
"""With ``distinct``, a split gives up after this many draws in a row that it already holds."""


def _once(
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


def _small_split_rule(name: str, report: dict[str, Any], classify: bool) -> str | None:
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
