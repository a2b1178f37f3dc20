"""Sequence-to-sequence tasks for ``EncoderDecoder``: copy, reverse, sort and addition.

Token encoding: PAD=0, BOS=1, EOS=2, then the task's symbols from id 3.

* ``copy``, ``reverse``, ``sort``: symbols are the first ``num_symbols`` lower-case letters
  ("a" = 3, "b" = 4, ...). Source = x_1 .. x_n EOS; target = x (copy), x reversed (reverse), or
  x sorted by id (sort). "cab" -> source [5, 3, 4, 2], sort target [3, 4, 5]. Distinct sources of
  length n: num_symbols^n.
* ``addition``: symbols "0".."9" (ids 3..12) and "+" (13). Source = the digits of a, "+", the
  digits of b, EOS, most significant digit first; target = the digits of a + b. "12+5" ->
  source [4, 5, 13, 8, 2], target [4, 10] ("17"). The length of an example is the width of its
  wider operand; distinct problems of width n: 10^(2n) - 10^(2(n-1)).

The decoder reads ``tgt_in`` = BOS + target and predicts ``tgt_out`` = target + EOS (the shift
right of Agarwal §5.2); batching builds both. Splits: train/valid/test have lengths 1..L and are
disjoint by a seeded hash of the source (:func:`attnlab.tasks.base.split_of`); the
length-generalisation split has lengths L+1..2L, and each bin of ``eval_lengths`` (``[[11, 20],
[21, 40]]``) is a split of its own, ``length_11_20``, drawn the same way. Lengths are drawn uniformly, except that the
shortest, with few distinct sources, are drawn in proportion to how many a split holds
(:func:`attnlab.tasks.base.weigh_lengths`).
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable
from dataclasses import dataclass, field

from attnlab.errors import ConfigError
from attnlab.tasks.base import (
    Example,
    Vocab,
    VocabIds,
    check_horizon_threshold,
    check_length_bins,
    check_sizes,
    split_of,
    spread_lengths,
    weigh_lengths,
)

__all__ = ["TRANSFORMS", "Seq2SeqTask", "AdditionTask"]

MAX_TRIES_PER_EXAMPLE = 2000

TRANSFORMS: dict[str, Callable[[tuple[int, ...]], tuple[int, ...]]] = {
    "copy": lambda xs: xs,
    "reverse": lambda xs: xs[::-1],
    "sort": lambda xs: tuple(sorted(xs)),
}
"""Registry: task name -> the map from source ids to target ids."""


@dataclass(frozen=True)
class _SplitConfig(VocabIds):
    """Options shared by the synthetic seq2seq tasks (see the module docstring); ``horizon_threshold``:
    the accuracy a length must reach to count within the generalisation horizon, in (0, 1]
    (:func:`attnlab.evaluation.horizon.horizon`)."""

    max_train_length: int = 8
    train_size: int = 2000
    valid_size: int = 200
    test_size: int = 200
    length_generalisation_size: int = 200
    seed: int = 0
    eval_lengths: list[list[int]] = field(default_factory=list)
    fresh_examples: bool = False
    """Train on examples drawn afresh for every batch (Delétang et al. 2023; :meth:`fresh_train`)."""
    horizon_threshold: float = 0.95

    kind = "seq2seq"

    def __post_init__(self) -> None:
        if self.max_train_length < 1:
            raise ConfigError(f"max_train_length: must be >= 1, got {self.max_train_length}")
        check_sizes(
            train_size=self.train_size,
            valid_size=self.valid_size,
            test_size=self.test_size,
            length_generalisation_size=self.length_generalisation_size,
        )
        check_length_bins(self.eval_lengths, self.max_train_length)
        check_horizon_threshold(self.horizon_threshold)

    @property
    def vocab(self) -> Vocab:
        raise NotImplementedError

    def split(self, name: str) -> list[Example]:
        """``{name}_size`` examples; lengths weighted by :func:`~attnlab.tasks.base.weigh_lengths`, or
        held out by length, each length equally often (:func:`~attnlab.tasks.base.spread_lengths`)."""
        self.check_split(name)
        return self._examples(name, self.split_size(name), random.Random(f"{self.seed}:{self.name}:{name}"))

    def fresh_train(self, rng: random.Random, size: int) -> list[Example]:
        """``size`` training examples drawn from ``rng`` as the train split draws its own (same
        lengths and weights, only inputs the train split owns): one batch of ``fresh_examples``."""
        return self._examples("train", size, rng)

    def _examples(self, name: str, size: int, rng: random.Random) -> list[Example]:
        lengths, weights = weigh_lengths(
            self.share_name(name), {n: self.num_distinct(n) for n in self.lengths(name)}, size
        )
        if self.held_out_by_length(name):
            order = spread_lengths(lengths, size, random.Random(f"{self.seed}:{self.name}:{name}:lengths"))
            return [self._draw(rng, name, [n], [1.0]) for n in order]
        return [self._draw(rng, name, lengths, weights) for _ in range(size)]

    def _draw(self, rng: random.Random, name: str, lengths: list[int], weights: list[float]) -> Example:
        for _ in range(MAX_TRIES_PER_EXAMPLE):
            # A fresh length per try: a short length may own no string of this split at all.
            example = self.sample(rng, rng.choices(lengths, weights)[0])
            if self.held_out_by_length(name) or split_of(self.seed, self.vocab.decode(example.source)) == name:
                return example
        raise ConfigError(f"{self.name}: could not draw a {name} example; too few exist, raise max_train_length")

    def num_distinct(self, length: int) -> int:
        raise NotImplementedError

    @property
    def name(self) -> str:
        raise NotImplementedError

    def sample(self, rng: random.Random, length: int) -> Example:
        raise NotImplementedError


@dataclass(frozen=True)
class Seq2SeqTask(_SplitConfig):
    """``copy``, ``reverse`` or ``sort`` a string of letters (see the module docstring).

    Attributes:
        transform: a key of :data:`TRANSFORMS`.
        num_symbols: alphabet size, 1..26.
        max_train_length, *_size, seed: as in :class:`attnlab.tasks.formal.RecognitionTask`.
    """

    transform: str = "copy"
    num_symbols: int = 10

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.transform not in TRANSFORMS:
            raise ConfigError(f"transform: unknown {self.transform!r}; choose one of {', '.join(TRANSFORMS)}")
        if not 1 <= self.num_symbols <= 26:
            raise ConfigError(f"num_symbols: must lie in [1, 26], got {self.num_symbols}")

    @property
    def name(self) -> str:
        return self.transform

    @property
    def vocab(self) -> Vocab:
        return Vocab.of(string.ascii_lowercase[: self.num_symbols])

    def num_distinct(self, length: int) -> int:
        return self.num_symbols**length

    def sample(self, rng: random.Random, length: int) -> Example:
        first = len(self.vocab) - self.num_symbols
        xs = tuple(rng.randrange(first, len(self.vocab)) for _ in range(length))
        return Example(source=xs + (self.eos_id,), target=TRANSFORMS[self.transform](xs), length=length)


@dataclass(frozen=True)
class AdditionTask(_SplitConfig):
    """Multi-digit addition with digits as tokens (see the module docstring)."""

    max_train_length: int = 4

    @property
    def name(self) -> str:
        return "addition"

    @property
    def vocab(self) -> Vocab:
        return Vocab.of(tuple(string.digits) + ("+",))

    def num_distinct(self, length: int) -> int:
        """Pairs (a, b) whose wider operand has ``length`` digits."""
        return 10 ** (2 * length) - (10 ** (2 * (length - 1)) if length > 1 else 0)

    def sample(self, rng: random.Random, length: int) -> Example:
        low = 10 ** (length - 1) if length > 1 else 0
        while True:
            # Uniform over pairs whose wider operand has exactly `length` digits.
            a, b = rng.randrange(10**length), rng.randrange(10**length)
            if max(a, b) >= low:
                break
        source = self.vocab.encode(tuple(str(a)) + ("+",) + tuple(str(b))) + (self.eos_id,)
        return Example(source=source, target=self.vocab.encode(tuple(str(a + b))), length=length)
