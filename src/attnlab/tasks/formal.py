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

Membership is decided by checkers written independently of the generators (counting and
rewriting rather than construction), so tests can hold one against the other.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache

from attnlab.errors import ConfigError
from attnlab.tasks.base import Example, Vocab, VocabIds, check_sizes, check_split_name, split_of, weigh_lengths

__all__ = ["LANGUAGES", "Language", "RecognitionTask", "near_misses"]

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


def _blocks_positive(letters: str) -> Callable[[random.Random, int], str | None]:
    def sample(rng: random.Random, n: int) -> str | None:
        if n % len(letters) or n == 0:
            return None
        return "".join(letter * (n // len(letters)) for letter in letters)

    return sample


def _catalan(k: int) -> int:
    return math.comb(2 * k, k) // (k + 1)


@dataclass(frozen=True)
class Language:
    """A formal language: its alphabet, membership checker, sampler and positive count."""

    name: str
    alphabet: str
    contains: Callable[[str], bool]
    sample_positive: Callable[[random.Random, int], str | None]
    count_positive: Callable[[int], int]

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

    def near_miss_sources(self, n: int) -> dict[int, int]:
        """Base length -> an upper bound on the near-misses of length ``n`` it yields.

        A change or a swap keeps a positive's length; a drop shortens it by one.
        """
        k, m = len(self.alphabet), n + 1
        return {
            n: self.count_positive(n) * (n * (k - 1) + (n - 1)),  # changes and swaps
            m: self.count_positive(m) * m,  # drops
        }

    def count_near_misses(self, n: int) -> int:
        """An upper bound on the non-members of length ``n`` one edit away from a positive."""
        return min(sum(self.near_miss_sources(n).values()), len(self.alphabet) ** n - self.count_positive(n))


LANGUAGES: dict[str, Language] = {
    "parity": Language("parity", "01", is_parity, _parity_positive, lambda n: 2 ** (n - 1) if n > 0 else 0),
    "dyck1": Language(
        "dyck1", "()", is_dyck1, _dyck_positive("("), lambda n: _catalan(n // 2) if n > 0 and n % 2 == 0 else 0
    ),
    "dyck2": Language(
        "dyck2",
        "()[]",
        is_dyck2,
        _dyck_positive("(["),
        lambda n: _catalan(n // 2) * 2 ** (n // 2) if n > 0 and n % 2 == 0 else 0,
    ),
    "anbn": Language("anbn", "ab", is_anbn, _blocks_positive("ab"), lambda n: int(n > 0 and n % 2 == 0)),
    "anbncn": Language("anbncn", "abc", is_anbncn, _blocks_positive("abc"), lambda n: int(n > 0 and n % 3 == 0)),
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


@dataclass(frozen=True)
class RecognitionTask(VocabIds):
    """Recognise one formal language; see the module docstring for encodings and counts.

    Attributes:
        language: a key of :data:`LANGUAGES`.
        max_train_length: L. train/valid/test strings have 1..L symbols; the
            length-generalisation split has L+1..2L.
        train_size, valid_size, test_size, length_generalisation_size: examples per split
            (half positive). Within a split a string may repeat when the language is small;
            across splits never.
        seed: the seed of every draw and of the split assignment.
    """

    language: str = "parity"
    max_train_length: int = 16
    train_size: int = 2000
    valid_size: int = 200
    test_size: int = 200
    length_generalisation_size: int = 200
    seed: int = 0

    kind = "recognition"

    def __post_init__(self) -> None:
        if self.language not in LANGUAGES:
            raise ConfigError(f"language: unknown language {self.language!r}; choose one of {', '.join(LANGUAGES)}")
        if self.max_train_length < 1:
            raise ConfigError(f"max_train_length: must be >= 1, got {self.max_train_length}")
        check_sizes(
            train_size=self.train_size,
            valid_size=self.valid_size,
            test_size=self.test_size,
            length_generalisation_size=self.length_generalisation_size,
        )

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

    # ---- splits -------------------------------------------------------------------------------

    def split(self, name: str) -> list[Example]:
        """The examples of split ``name``, balanced, in a seeded random order."""
        check_split_name(name)
        size = getattr(self, f"{name}_size")
        rng = random.Random(f"{self.seed}:{self.language}:{name}")
        positives = self._positive_sampler(name, draws=size // 2)
        negatives = self._negative_sampler(name, draws=size - size // 2)
        examples = [self.encode(positives(rng), 1) for _ in range(size // 2)]
        examples += [self.encode(negatives(rng), 0) for _ in range(size - size // 2)]
        rng.shuffle(examples)
        return examples

    def _owns(self, name: str, string: str) -> bool:
        return name == "length_generalisation" or split_of(self.seed, string) == name

    def _positive_sampler(self, name: str, draws: int) -> Callable[[random.Random], str]:
        counts = {n: self.lang.count_positive(n) for n in self.lengths(name)}
        lengths, weights = weigh_lengths(name, counts, draws)
        if not lengths:
            raise ConfigError(
                f"max_train_length: {self.language} has no string with a length in "
                f"[{self.lengths(name).start}, {self.lengths(name).stop - 1}]; raise max_train_length"
            )
        if name != "length_generalisation" and sum(counts.values()) <= SMALL_LANGUAGE:
            pool = self._dealt_positives(lengths)[name]
            return lambda rng: rng.choice(pool)

        def candidate(rng: random.Random) -> str | None:
            return self.lang.sample_positive(rng, rng.choices(lengths, weights)[0])

        return lambda rng: self._draw(rng, candidate, name)

    def _dealt_positives(self, lengths: list[int]) -> dict[str, list[str]]:
        # Few positives: hashing could leave valid or test without any. Deal them instead, by a
        # seeded shuffle, 80/10/10 with at least one each. Still a partition: no string in two splits.
        pool = [s for n in lengths for s in self.lang.positives(n)]
        if len(pool) < 3:
            raise ConfigError(
                f"max_train_length: {self.language} has only {len(pool)} strings of length <= "
                f"{self.max_train_length}, too few for train, valid and test; raise max_train_length"
            )
        random.Random(f"{self.seed}:{self.language}:deal").shuffle(pool)
        held = max(1, round(0.1 * len(pool)))
        return {"test": pool[:held], "valid": pool[held : 2 * held], "train": pool[2 * held :]}

    def _negative_sampler(self, name: str, draws: int) -> Callable[[random.Random], str]:
        counts = {n: self.lang.count_near_misses(n) for n in self.lengths(name)}
        lengths, weights = weigh_lengths(name, counts, draws)

        def candidate(rng: random.Random) -> str | None:
            n = rng.choices(lengths, weights)[0]
            sources = {m: bound for m, bound in self.lang.near_miss_sources(n).items() if bound > 0}
            base = self.lang.sample_positive(rng, rng.choices(list(sources), list(sources.values()))[0])
            if base is None:
                return None
            misses = [s for s in near_misses(base, self.lang.alphabet) if len(s) == n and not self.lang.contains(s)]
            return rng.choice(misses) if misses else None

        return lambda rng: self._draw(rng, candidate, name)

    def _draw(self, rng: random.Random, candidate: Callable[[random.Random], str | None], name: str) -> str:
        for _ in range(MAX_TRIES_PER_EXAMPLE):
            s = candidate(rng)
            if s is not None and self._owns(name, s):
                return s
        raise ConfigError(
            f"{self.language}: could not draw a {name} string in {MAX_TRIES_PER_EXAMPLE} tries; "
            "the language has too few strings of these lengths, raise max_train_length"
        )
