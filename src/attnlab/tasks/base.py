"""What every task shares: examples, a fixed vocabulary, and leak-free split assignment.

A task yields four splits of :class:`Example`:

* ``train``, ``valid``, ``test``: lengths 1..L, where L = ``max_train_length``;
* ``length_generalisation``: lengths in (L, 2L], never seen in training.

Train, valid and test never share a string: each candidate string is assigned to one of them by a
seeded hash of its text (:func:`split_of`), 80% / 10% / 10%, and a split only keeps the strings
assigned to it. The length-generalisation split is disjoint from the others by length.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from attnlab.errors import ConfigError

__all__ = [
    "SPLITS",
    "TASK_SPECIALS",
    "Example",
    "Vocab",
    "Task",
    "SplitAccessors",
    "VocabIds",
    "split_of",
    "split_share",
    "split_statistics",
    "weigh_lengths",
    "check_sizes",
    "check_horizon_threshold",
    "spread_lengths",
]

SPLITS = ("train", "valid", "test", "length_generalisation")
SplitName = Literal["train", "valid", "test", "length_generalisation"]
TaskKind = Literal["recognition", "next_char", "classification", "seq2seq", "lm", "embedding"]

TASK_SPECIALS = ("[PAD]", "[BOS]", "[EOS]")
"""The specials of the synthetic tasks: PAD=0, BOS=1, EOS=2; task symbols follow from id 3."""

_SHARES = (("train", 0.8), ("valid", 0.9), ("test", 1.0))


def split_share(name: str) -> float:
    """The fraction of all strings of lengths 1..L that split ``name`` owns (1 for length generalisation)."""
    if name == "length_generalisation":
        return 1.0
    uppers = dict(_SHARES)
    lower = {"train": 0.0, "valid": uppers["train"], "test": uppers["valid"]}[name]
    return uppers[name] - lower


def weigh_lengths(name: str, counts: dict[int, int], draws: int) -> tuple[list[int], list[float]]:
    """Lengths to draw split ``name`` from, and their weights.

    Uniform over lengths, except that a length of which the split holds fewer strings than it
    draws (share * count < draws) weighs only that many: otherwise the one or two shortest
    strings would fill a large part of a split by repetition.

    Args:
        name: the split.
        counts: length -> how many distinct strings (of the class drawn) have that length.
        draws: how many examples the split draws.
    """
    share, cap = split_share(name), max(draws, 1)
    lengths = [n for n, count in counts.items() if count > 0]
    # Compare before multiplying: counts such as 10^(2n) need not fit in a float.
    return lengths, [cap if counts[n] >= cap / share else share * counts[n] for n in lengths]


@dataclass(frozen=True)
class Example:
    """One example, as token ids.

    Attributes:
        source: the input sequence (recognition: the string followed by EOS; seq2seq: the source
            followed by EOS; lm: empty).
        target: the output sequence without BOS/EOS (seq2seq, lm), or None. Batching builds
            ``tgt_in = BOS + target`` and ``tgt_out = target + EOS`` from it.
        label: 1 = in the language, 0 = not (recognition); a class 0..C-1 (classification); or None.
        length: the length that decides the split (symbols before EOS, or the operand width).
        next_symbols: ``next_char`` recognition only: for each position of ``tgt_in`` = BOS +
            target, the set of token ids that may come next, as a bit mask (bit i = id i).
    """

    source: tuple[int, ...]
    target: tuple[int, ...] | None = None
    label: int | None = None
    length: int = 0
    next_symbols: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.label is not None and self.label < 0:
            raise ValueError(f"label: must be >= 0, got {self.label}")
        if self.length < 0:
            raise ValueError(f"length: must be >= 0, got {self.length}")
        if self.next_symbols is not None and len(self.next_symbols) != len(self.target or ()) + 1:
            raise ValueError(
                f"next_symbols: one mask per position of BOS + target ({len(self.target or ()) + 1}), "
                f"got {len(self.next_symbols)}"
            )


@dataclass(frozen=True)
class Vocab:
    """A fixed vocabulary: ``tokens[i]`` is the text of id i; PAD=0, BOS=1, EOS=2."""

    tokens: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.tokens[: len(TASK_SPECIALS)] != TASK_SPECIALS:
            raise ValueError(f"tokens: must start with {TASK_SPECIALS}, got {self.tokens[:3]}")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("tokens: repeated token")

    @classmethod
    def of(cls, symbols: str | tuple[str, ...]) -> Vocab:
        return cls(TASK_SPECIALS + tuple(symbols))

    @property
    def pad_id(self) -> int:
        return 0

    @property
    def bos_id(self) -> int:
        return 1

    @property
    def eos_id(self) -> int:
        return 2

    def __len__(self) -> int:
        return len(self.tokens)

    def encode(self, symbols: str | tuple[str, ...]) -> tuple[int, ...]:
        lookup = {token: i for i, token in enumerate(self.tokens)}
        return tuple(lookup[s] for s in symbols)

    def decode(self, ids: tuple[int, ...] | list[int]) -> str:
        """Symbols of ``ids`` joined by spaces, specials included (so EOS is visible)."""
        return " ".join(self.tokens[i] for i in ids)


class Task(Protocol):
    """What training and evaluation ask of a task."""

    kind: TaskKind

    @property
    def vocab_size(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def split(self, name: SplitName) -> list[Example]: ...


class SplitAccessors:
    """``train()``, ``valid()``, ``test()`` and ``length_generalisation()`` as ``split(name)``."""

    def split(self, name: str) -> list[Example]:
        raise NotImplementedError

    def train(self) -> list[Example]:
        return self.split("train")

    def valid(self) -> list[Example]:
        return self.split("valid")

    def test(self) -> list[Example]:
        return self.split("test")

    def length_generalisation(self) -> list[Example]:
        return self.split("length_generalisation")


class VocabIds(SplitAccessors):
    """Size and special ids of a synthetic task, read off its :class:`Vocab` (``self.vocab``)."""

    vocab: Vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def pad_id(self) -> int:
        return self.vocab.pad_id

    @property
    def bos_id(self) -> int:
        return self.vocab.bos_id

    @property
    def eos_id(self) -> int:
        return self.vocab.eos_id

    # ---- splits, length and depth bins included ------------------------------------------------

    @property
    def length_bins(self) -> dict[str, tuple[int, int]]:
        """Split name -> (low, high) of every bin of the task's ``eval_lengths``, in order."""
        return {length_bin_name(low, high): (low, high) for low, high in getattr(self, "eval_lengths", ())}

    @property
    def depth_bins(self) -> dict[str, tuple[int, int]]:
        """Split name -> (low, high) of every bin of the task's ``eval_depths`` (nesting depths), in order;
        none for a task without them."""
        return {depth_bin_name(low, high): (low, high) for low, high in getattr(self, "eval_depths", ())}

    def depth_bin_lengths(self) -> range:
        """The lengths a depth bin draws from (the task says which; none by default)."""
        return range(0)

    def split_names(self) -> tuple[str, ...]:
        """Every split this task has: train, valid, test, length_generalisation, the length bins,
        then the depth bins."""
        return SPLITS + tuple(self.length_bins) + tuple(self.depth_bins)

    def check_split(self, name: str) -> None:
        if name not in self.split_names():
            raise ConfigError(f"split: unknown split {name!r}; choose one of {', '.join(self.split_names())}")

    def held_out_by_length(self, name: str) -> bool:
        """Whether split ``name`` is apart from training by its lengths (length_generalisation, a length
        or depth bin)."""
        return name == "length_generalisation" or name in self.length_bins or name in self.depth_bins

    def share_name(self, name: str) -> str:
        """The split whose share of the strings ``name`` owns (:func:`split_share`): a length bin owns
        every string of its lengths, as length_generalisation does."""
        return "length_generalisation" if self.held_out_by_length(name) else name

    def split_size(self, name: str) -> int:
        """Examples split ``name`` draws: ``{name}_size``; a length or depth bin draws
        ``length_generalisation_size``."""
        binned = name in self.length_bins or name in self.depth_bins
        return getattr(self, "length_generalisation_size" if binned else f"{name}_size")

    def lengths(self, split: str) -> range:
        """The lengths a split draws from: 1..L, L+1..2L for length generalisation, a length bin's,
        or for a depth bin :meth:`depth_bin_lengths`."""
        if split in self.length_bins:
            low, high = self.length_bins[split]
            return range(low, high + 1)
        if split in self.depth_bins:
            return self.depth_bin_lengths()
        L = self.max_train_length  # type: ignore[attr-defined]
        return range(L + 1, 2 * L + 1) if split == "length_generalisation" else range(1, L + 1)


def split_of(seed: int, text: str) -> str:
    """``train``, ``valid`` or ``test``: where the string ``text`` lives, by a seeded hash.

    SHA-256 rather than ``hash()``: Python salts ``hash`` per process, and the split of a string
    must be the same in every run.
    """
    digest = hashlib.sha256(f"{seed}\x00{text}".encode("utf-8", "surrogatepass")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    return next(name for name, upper in _SHARES if u < upper)


def split_statistics(examples: Sequence[Example]) -> dict[str, int]:
    """How many examples, distinct strings, positives and distinct positives ``examples`` hold.

    A string is its (source, target) token ids; a positive has label 1.
    """
    keys = [(e.source, e.target) for e in examples]
    positive_keys = [k for k, e in zip(keys, examples) if e.label == 1]
    return {
        "examples": len(examples),
        "distinct_strings": len(set(keys)),
        "positives": len(positive_keys),
        "distinct_positives": len(set(positive_keys)),
    }


def check_sizes(**sizes: int) -> None:
    """Refuse a negative split size, and an empty validation split: every evaluation during
    training and the choice of the best checkpoint score it, so ``valid_size = 0`` would train
    blind while reporting success."""
    for name, value in sizes.items():
        if value < 0:
            raise ConfigError(f"{name}: must be >= 0, got {value}")
    if sizes.get("valid_size") == 0:
        raise ConfigError("valid_size: must be >= 1 (the validation split scores training), got 0")


def spread_lengths(lengths: Sequence[int], draws: int, rng: random.Random) -> list[int]:
    """Each example's length in a split held out by length, so that every length is evaluated.

    The k lengths (those with strings) take ``draws // k`` examples each and ``draws % k`` of them,
    chosen by ``rng``, one more; the list is in ``rng``'s order. With ``draws < k`` some lengths get
    none (the evaluation reports them absent).
    """
    k = len(lengths)
    if k == 0:
        return []
    extra = set(rng.sample(range(k), draws % k))
    order = [n for i, n in enumerate(lengths) for _ in range(draws // k + (i in extra))]
    rng.shuffle(order)
    return order


def check_horizon_threshold(threshold: Any) -> None:
    """Refuse a ``horizon_threshold`` outside (0, 1] (the accuracy a length must reach to count as
    generalised, :func:`attnlab.evaluation.horizon.horizon`).

    Raises:
        ConfigError: names ``horizon_threshold``.
    """
    if not 0.0 < threshold <= 1.0:
        raise ConfigError(f"horizon_threshold: must lie in (0, 1], got {threshold}")


def depth_bin_name(low: int, high: int) -> str:
    """The split name of the depth bin [low, high]: ``depth_10_20``."""
    return f"depth_{low}_{high}"


def length_bin_name(low: int, high: int) -> str:
    """The split name of the length bin [low, high]: ``length_13_24``."""
    return f"length_{low}_{high}"


def check_length_bins(bins: Any, max_train_length: int) -> None:
    """Reject ``eval_lengths`` that are not ordered, disjoint ``[low, high]`` bins above L.

    Raises:
        ConfigError: names ``eval_lengths`` and the bin at fault.
    """
    _check_bins("eval_lengths", bins, max_train_length, f"max_train_length={max_train_length}",
                "bins are ordered, disjoint and longer than the training strings")  # fmt: skip


def check_depth_bins(bins: Any) -> None:
    """Reject ``eval_depths`` that are not ordered, disjoint ``[low, high]`` bins of depths >= 1.

    Raises:
        ConfigError: names ``eval_depths`` and the bin at fault.
    """
    _check_bins("eval_depths", bins, 0, "depth 1 is the least", "bins are ordered and disjoint")


def _check_bins(key: str, bins: Any, floor: int, floor_text: str, rule: str) -> None:
    """Ordered, disjoint ``[low, high]`` integer pairs, every low above ``floor`` (``key`` names them)."""
    if not isinstance(bins, (list, tuple)):
        raise ConfigError(f"{key}: expected a list of [low, high] pairs, got {bins!r}")
    previous_high = floor
    for index, item in enumerate(bins):
        pair_ok = isinstance(item, (list, tuple)) and len(item) == 2
        if not pair_ok or not all(isinstance(v, int) and not isinstance(v, bool) for v in item):
            raise ConfigError(f"{key}: bin {index + 1} is {item!r}; expected a pair of integers [low, high]")
        low, high = item
        if low > high:
            raise ConfigError(f"{key}: bin {index + 1} [{low}, {high}] is empty; low must be <= high")
        if low <= previous_high:
            where = floor_text if index == 0 else f"the end of bin {index}"
            raise ConfigError(
                f"{key}: bin {index + 1} [{low}, {high}] must start above {previous_high} ({where}); {rule}"
            )
        previous_high = high


def check_final_splits(task: object, names: Sequence[str]) -> None:
    """Refuse a ``train.final_splits`` entry that is not one of ``task``'s splits, before training.

    Raises:
        ConfigError: names ``train.final_splits``, the split, and the task's splits.
    """
    split_names = getattr(task, "split_names", None)
    known = split_names() if callable(split_names) else SPLITS
    for name in names:
        if name not in known:
            raise ConfigError(f"train.final_splits: unknown split {name!r}; this task has {', '.join(known)}")


def check_split_name(name: str) -> None:
    if name not in SPLITS:
        raise ConfigError(f"split: unknown split {name!r}; choose one of {', '.join(SPLITS)}")
