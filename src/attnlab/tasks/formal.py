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
accuracy of such a shortcut (:meth:`RecognitionTask.split_report`, :data:`.formal_splits.COUNTING_BASELINES`);
a held-out split with fewer than :data:`.formal_splits.MIN_DISTINCT_STRINGS` distinct strings (or, classifying,
:data:`.formal_splits.MIN_DISTINCT_POSITIVES` distinct positives) is warned about.

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
:func:`.formal_dyck.dyck_derivation` for its closed forms; the counter languages a block count uniform over
the split's), and ``task.distinct = true`` keeps every split free of repeats. ``task.fresh_examples``
trains on a new batch from the training split's distribution at every step (Delétang et al. 2023).

Membership is decided by checkers written independently of the generators (counting and
rewriting rather than construction), so tests can hold one against the other.

The languages are in one module per family: :mod:`.formal_parity`, :mod:`.formal_dyck` (with the
paper's grammar) and :mod:`.formal_counter`, each a :class:`~.formal_base.Language`; what a split
is measured against (its shortcut and majority baselines) is in :mod:`.formal_splits`.
"""

from __future__ import annotations

import math
import random
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
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
    split_of,
    split_share,
    split_statistics,
    spread_lengths,
    weigh_lengths,
)
from attnlab.tasks.formal_base import END, Language, near_misses
from attnlab.tasks.formal_counter import ANBN, ANBNCN
from attnlab.tasks.formal_dyck import DYCK1, DYCK2, bracket_depth
from attnlab.tasks.formal_parity import PARITY
from attnlab.tasks.formal_splits import baseline_accuracy, majority_label, once, small_split_rule

__all__ = [
    "FORMULATIONS",
    "LANGUAGES",
    "RecognitionTask",
    "SAMPLERS",
    "check_grammar",
]

SMALL_LANGUAGE = 256
"""Up to this many positives of length <= L, positives are dealt to the splits, not hashed."""

MAX_TRIES_PER_EXAMPLE = 2000


LANGUAGES: dict[str, Language] = {
    "parity": PARITY,
    "dyck1": DYCK1,
    "dyck2": DYCK2,
    "anbn": ANBN,
    "anbncn": ANBNCN,
}
"""Registry: language name -> :class:`Language`, one module per family of language."""


FORMULATIONS = ("classify", "next_char")
"""``classify``: membership, the label read at EOS (Hahn §3). ``next_char``: the set of symbols that
may follow each prefix (Bhattamishra, Ahuja & Goyal 2020)."""

BALANCED_SHARE = 0.5
"""The share of a Dyck split's negatives that are balanced-count transpositions (rounded up)."""


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
            al. 2020, :attr:`Language.grammar`: for Dyck the grammar of :func:`.formal_dyck.dyck_derivation`
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
            positives = once(self._positive_sampler(name, draws=size), seen, self._too_few(name, size))
            return [self.encode_next_char(positives(rng)) for _ in range(size)]
        negatives_wanted = size - size // 2
        balanced = math.ceil(BALANCED_SHARE * negatives_wanted) if self.lang.has_balanced_negatives else 0
        too_few = self._too_few(name, size)
        positives = once(self._positive_sampler(name, draws=size // 2), seen, too_few)
        examples = [self.encode(positives(rng), 1) for _ in range(size // 2)]
        if negatives_wanted - balanced:
            negatives = once(self._negative_sampler(name, draws=negatives_wanted - balanced), seen, too_few)
            examples += [self.encode(negatives(rng), 0) for _ in range(negatives_wanted - balanced)]
        if balanced:
            swapped = once(self._balanced_sampler(name, draws=balanced), seen, too_few)
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
        lengths (its share of them, for train, valid and test); :func:`.formal_splits.once` catches the rest."""
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
        reason = small_split_rule(name, report, classify=self.formulation == "classify")
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
        :data:`.formal_splits.MIN_DISTINCT_STRINGS` distinct strings, or (``classify``) fewer than
        :data:`.formal_splits.MIN_DISTINCT_POSITIVES` distinct positives, is warned about (:class:`AttnlabWarning`).
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
