"""The length-generalisation tasks of Delétang et al. 2023, "Neural Networks and the Chomsky Hierarchy" (ICLR).

Each task is placed, as the paper places it, at the lowest level of the Chomsky hierarchy whose
automaton solves it: a finite-state automaton (regular, R), a deterministic push-down automaton
(deterministic context-free, DCF), or a linearly bounded automaton (context-sensitive, CS).

=====================  =====  ======================  ==================================  ==========================
task                   level  input alphabet          output                              formulation
=====================  =====  ======================  ==================================  ==========================
even_pairs             R      0 1                     (#"01" + #"10") mod 2               2 classes
cycle_navigation       R      0 + - (stay, +1, -1)    final position on a 5-cycle from 0  5 classes
modular_arithmetic     R      0..4 and + - *          the expression's value mod 5        5 classes
reverse_string         DCF    0 1                     w reversed                          sequence of n symbols
stack_manipulation     DCF    0 1 POP PUSH0 PUSH1     the final stack, top first          sequence + terminator
duplicate_string       CS     0 1                     w w                                 sequence of 2n symbols
binary_addition        CS     0 1 +                   a + b, little-endian binary         sequence + terminator
binary_multiplication  CS     0 1 *                   a * b, little-endian binary         sequence + terminator
=====================  =====  ======================  ==================================  ==========================

Definitions (as the paper's tasks and its code, google-deepmind/neural_networks_chomsky_hierarchy):

* ``even_pairs``: w in {0,1}^n; label (sum_i [w_i != w_{i+1}]) mod 2 (0 = even). "001110" -> 0.
* ``cycle_navigation``: n moves in {0: stay, +: +1, -: -1} from position 0 on a cycle of 5;
  label (#"+" - #"-") mod 5. "+-0--" -> 3.
* ``modular_arithmetic``: d_1 o_1 d_2 ... o_k d_{k+1}, digits in {0..4}, operators in {+, -, *},
  with the usual precedence (* before + and -), no brackets; label its value mod 5. The length
  n = 2k + 1 is odd (the paper turns an even length into the odd one below it; here an even
  length has no strings). "1+2*3" -> 2; "1-1-1" -> 4.
* ``reverse_string``: w in {0,1}^n -> w_n ... w_1.
* ``stack_manipulation``: a stack s in {0,1}^m given bottom to top (1 <= m < n, m uniform), then
  n - m actions, each uniform in {POP, PUSH0, PUSH1}, applied left to right (POP on an empty
  stack does nothing); the output is the final stack top to bottom. Length 1 is one bit, output
  that bit. "0 1 1 0 PUSH1 POP POP" -> "1 1 0".
* ``duplicate_string``: w in {0,1}^n -> w w.
* ``binary_addition``, ``binary_multiplication``: "a+b" (or "a*b"), a and b little-endian binary
  (least significant bit first) of widths p and n - 1 - p, p uniform in [1, n - 2], each value
  uniform in [1, 2^width - 1] (a width may end in 0s: the leading zeros of big-endian); the output
  is a + b (a * b) little-endian without leading zeros. "001+01101" (4 + 22) -> "01011". An
  expression needs 3 symbols, so lengths 1 and 2 have none here (the paper fills them with a lone
  number).

Output formulation. The regular tasks are classification: an :class:`~attnlab.nn.EncoderClassifier`
reads the class at the EOS position, with ``num_classes`` = 2, 5, 5 (the task sets it). The others
are sequence outputs for the encoder-decoder: source = input + EOS, target = the output, and the
decoder predicts target + EOS. The paper ends the outputs of stack manipulation and binary
addition/multiplication with a termination symbol and scores it; EOS plays that role here
(``scores_terminator``). Reverse and duplicate have fixed output lengths n and 2n, so only the
symbols are scored.

Metric. The paper scores a sequence by the fraction of its output tokens predicted right, and
averages that over sequences: acc = (1/N) sum_j (1/|y_j|) sum_i [yhat_{j,i} = y_{j,i}] (its
``accuracy_fn`` under ``accuracy_mask``), which :func:`attnlab.evaluation.metrics.token_accuracy_per_sequence`
computes; for these tasks it is ``accuracy`` in :func:`attnlab.evaluation.evaluate.evaluate`,
with exact match beside it as ``sequence_accuracy``. For one class, both are plain accuracy.

Lengths. The paper trains on lengths uniform in 1..40 (fresh samples at every step) and tests
on every length 41..500 (``max_range_test_length = 500``), reporting the accuracy averaged over
those lengths. Here the defaults keep training at 1..40 (``max_train_length``) and, to run on a
laptop's two cores, the length-generalisation split covers L+1..2L (41..80), reported per length
(``accuracy_by_length``). Splits are fixed sets: train/valid/test share lengths 1..L and are
disjoint by a seeded hash of the input (:func:`attnlab.tasks.base.split_of`); lengths are drawn
uniformly, the shortest in proportion to how many distinct inputs a split holds
(:func:`attnlab.tasks.base.weigh_lengths`). With ``task.fresh_examples = true`` training draws a new
batch at every step, as the paper does (from the train split's share of the inputs, so valid and
test stay unseen); the fixed train split then serves only the checks and the training-fit report.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from attnlab.errors import ConfigError
from attnlab.tasks.base import Example, Vocab
from attnlab.tasks.seq2seq import _SplitConfig

__all__ = [
    "CHOMSKY_TASKS",
    "LEVELS",
    "ChomskyTask",
    "EvenPairs",
    "CycleNavigation",
    "ModularArithmetic",
    "ReverseString",
    "StackManipulation",
    "DuplicateString",
    "BinaryAddition",
    "BinaryMultiplication",
    "evaluate_modular",
]

LEVELS = ("regular", "dcf", "cs")
"""The paper's levels: regular, deterministic context-free, context-sensitive."""

PAPER_MAX_TRAIN_LENGTH = 40
PAPER_TEST_LENGTHS = range(41, 501)
"""The lengths the paper tests on (documentation; the default split here is L+1..2L)."""

BITS = ("0", "1")
POP, PUSH0, PUSH1 = "POP", "PUSH0", "PUSH1"


@dataclass(frozen=True)
class ChomskyTask(_SplitConfig):
    """A task of Delétang et al. 2023 (see the module docstring).

    Attributes:
        max_train_length: L; train/valid/test inputs have lengths 1..L (the paper: 40), the
            length-generalisation split L+1..2L (the paper: 41..500).
        train_size, valid_size, test_size, length_generalisation_size: examples per split.
        seed: the seed of every draw and of the split assignment.
        fresh_examples: train on a batch drawn afresh at every step, as the paper does, rather
            than on the fixed ``train_size`` examples (:meth:`fresh_train`).
    """

    max_train_length: int = PAPER_MAX_TRAIN_LENGTH

    task_name: ClassVar[str] = ""
    level: ClassVar[str] = ""
    symbols: ClassVar[tuple[str, ...]] = BITS
    scores_terminator: ClassVar[bool] = False
    """Whether the paper's output ends with a scored termination symbol (here: EOS)."""
    headline_metric: ClassVar[str] = "token_accuracy_per_sequence"
    """The metric reported as ``accuracy`` (the paper's; see the module docstring)."""
    min_length: ClassVar[int] = 1
    """The shortest input that exists."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.max_train_length < self.min_length:
            raise ConfigError(
                f"max_train_length: must be >= {self.min_length} ({self.name} has no shorter input), "
                f"got {self.max_train_length}"
            )

    @property
    def name(self) -> str:
        return self.task_name

    @property
    def vocab(self) -> Vocab:
        return Vocab.of(self.symbols)

    def sample(self, rng: random.Random, length: int) -> Example:
        """One example whose input has ``length`` symbols, drawn as the paper draws it."""
        symbols = self.draw_input(rng, length)
        source = self.vocab.encode(symbols) + (self.eos_id,)
        return self.make_example(source, self.solve(symbols), length)

    def make_example(self, source: tuple[int, ...], answer: int | tuple[str, ...], length: int) -> Example:
        raise NotImplementedError

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        raise NotImplementedError

    def solve(self, symbols: tuple[str, ...]) -> int | tuple[str, ...]:
        """The answer to an input: a class (classification) or output symbols (sequences)."""
        raise NotImplementedError


@dataclass(frozen=True)
class _Classification(ChomskyTask):
    """A regular task: one class read at EOS by an encoder classifier."""

    kind: ClassVar[str] = "classification"
    headline_metric: ClassVar[str] = "accuracy"

    @property
    def num_classes(self) -> int:
        raise NotImplementedError

    def make_example(self, source: tuple[int, ...], answer: int | tuple[str, ...], length: int) -> Example:
        return Example(source=source, label=int(answer), length=length)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Transduction(ChomskyTask):
    """A task whose output is a sequence, for the encoder-decoder."""

    kind: ClassVar[str] = "seq2seq"

    def make_example(self, source: tuple[int, ...], answer: int | tuple[str, ...], length: int) -> Example:
        return Example(source=source, target=self.vocab.encode(answer), length=length)  # type: ignore[arg-type]


def _bits(rng: random.Random, n: int) -> tuple[str, ...]:
    return tuple(rng.choice(BITS) for _ in range(n))


# ---- regular --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvenPairs(_Classification):
    """Whether the number of "01" and "10" pairs in a binary string is even (class 0) or odd (1)."""

    task_name: ClassVar[str] = "even_pairs"
    level: ClassVar[str] = "regular"

    @property
    def num_classes(self) -> int:
        return 2

    def num_distinct(self, length: int) -> int:
        return 2**length

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        return _bits(rng, length)

    def solve(self, symbols: tuple[str, ...]) -> int:
        return sum(a != b for a, b in zip(symbols, symbols[1:])) % 2


@dataclass(frozen=True)
class CycleNavigation(_Classification):
    """The final position of a walk on a cycle of 5 from 0: moves "0" (stay), "+" (+1), "-" (-1)."""

    task_name: ClassVar[str] = "cycle_navigation"
    level: ClassVar[str] = "regular"
    symbols: ClassVar[tuple[str, ...]] = ("0", "+", "-")
    cycle_length: ClassVar[int] = 5

    @property
    def num_classes(self) -> int:
        return self.cycle_length

    def num_distinct(self, length: int) -> int:
        return 3**length

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        return tuple(rng.choice(self.symbols) for _ in range(length))

    def solve(self, symbols: tuple[str, ...]) -> int:
        step = {"0": 0, "+": 1, "-": -1}
        return sum(step[s] for s in symbols) % self.cycle_length


def evaluate_modular(symbols: tuple[str, ...], modulus: int) -> int:
    """The value of d_1 o_1 d_2 ... d_k (o in + - *, * binding tighter) modulo ``modulus``.

    Sums the products of the runs of factors joined by "*", each product signed by the operator
    before its run, as the paper's ``_evaluate_expression`` does.
    """
    total, sign, product = 0, 1, int(symbols[0])
    for operator, digit in zip(symbols[1::2], symbols[2::2]):
        if operator == "*":
            product *= int(digit)
            continue
        total += sign * product
        sign, product = (1 if operator == "+" else -1), int(digit)
    return (total + sign * product) % modulus


@dataclass(frozen=True)
class ModularArithmetic(_Classification):
    """An expression of digits 0..m-1 and + - * without brackets, reduced modulo m (the paper: m = 5).

    Attributes:
        modulus: m, 2..10; also the number of classes.
    """

    task_name: ClassVar[str] = "modular_arithmetic"
    level: ClassVar[str] = "regular"
    operators: ClassVar[tuple[str, ...]] = ("+", "-", "*")
    modulus: int = 5

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 2 <= self.modulus <= 10:
            raise ConfigError(f"modulus: must lie in [2, 10], got {self.modulus}")

    @property
    def symbols(self) -> tuple[str, ...]:  # type: ignore[override]
        return tuple(str(d) for d in range(self.modulus)) + self.operators

    @property
    def num_classes(self) -> int:
        return self.modulus

    def num_distinct(self, length: int) -> int:
        """Odd lengths only: (length + 1) / 2 digits and (length - 1) / 2 operators."""
        if length % 2 == 0:
            return 0
        return self.modulus ** ((length + 1) // 2) * len(self.operators) ** (length // 2)

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        digits = [str(rng.randrange(self.modulus)) for _ in range(length // 2 + 1)]
        operators = [rng.choice(self.operators) for _ in range(length // 2)]
        return tuple(s for pair in zip(digits, operators + [""]) for s in pair if s)

    def solve(self, symbols: tuple[str, ...]) -> int:
        return evaluate_modular(symbols, self.modulus)


# ---- deterministic context-free ---------------------------------------------------------------


@dataclass(frozen=True)
class ReverseString(_Transduction):
    """w in {0,1}^n -> w reversed."""

    task_name: ClassVar[str] = "reverse_string"
    level: ClassVar[str] = "dcf"

    def num_distinct(self, length: int) -> int:
        return 2**length

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        return _bits(rng, length)

    def solve(self, symbols: tuple[str, ...]) -> tuple[str, ...]:
        return symbols[::-1]


@dataclass(frozen=True)
class StackManipulation(_Transduction):
    """A stack (bottom to top) and POP / PUSH0 / PUSH1 actions -> the final stack, top to bottom."""

    task_name: ClassVar[str] = "stack_manipulation"
    level: ClassVar[str] = "dcf"
    symbols: ClassVar[tuple[str, ...]] = (*BITS, POP, PUSH0, PUSH1)
    scores_terminator: ClassVar[bool] = True

    def num_distinct(self, length: int) -> int:
        """Inputs of ``length`` symbols: sum over stack sizes m of 2^m * 3^(length - m)."""
        if length == 1:
            return 2
        return sum(2**m * 3 ** (length - m) for m in range(1, length))

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        if length == 1:
            return _bits(rng, 1)
        m = rng.randrange(1, length)
        return _bits(rng, m) + tuple(rng.choice((POP, PUSH0, PUSH1)) for _ in range(length - m))

    def solve(self, symbols: tuple[str, ...]) -> tuple[str, ...]:
        stack: list[str] = []
        for symbol in symbols:
            if symbol in BITS:
                stack.append(symbol)
            elif symbol == POP:
                if stack:
                    stack.pop()
            else:
                stack.append(symbol[-1])  # PUSH0 -> "0", PUSH1 -> "1"
        return tuple(reversed(stack))


# ---- context-sensitive ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DuplicateString(_Transduction):
    """w in {0,1}^n -> w w."""

    task_name: ClassVar[str] = "duplicate_string"
    level: ClassVar[str] = "cs"

    def num_distinct(self, length: int) -> int:
        return 2**length

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        return _bits(rng, length)

    def solve(self, symbols: tuple[str, ...]) -> tuple[str, ...]:
        return symbols + symbols


def _little_endian(value: int, width: int = 0) -> tuple[str, ...]:
    """``value`` in binary, least significant bit first, padded with 0s to ``width``."""
    return tuple(reversed(format(value, "b").zfill(width)))


@dataclass(frozen=True)
class _BinaryOperation(_Transduction):
    """ "a o b" over little-endian binary operands -> the result, little-endian (see the module docstring)."""

    level: ClassVar[str] = "cs"
    scores_terminator: ClassVar[bool] = True
    min_length: ClassVar[int] = 3
    operator: ClassVar[str] = "+"

    @property
    def symbols(self) -> tuple[str, ...]:  # type: ignore[override]
        return (*BITS, self.operator)

    def num_distinct(self, length: int) -> int:
        """Expressions of ``length`` symbols: operand widths p + q = length - 1, each value in [1, 2^w - 1]."""
        return sum((2**p - 1) * (2 ** (length - 1 - p) - 1) for p in range(1, length - 1))

    def draw_input(self, rng: random.Random, length: int) -> tuple[str, ...]:
        if length < 3:
            raise ConfigError(f"{self.name}: an expression needs at least 3 symbols, got length {length}")
        p = rng.randrange(1, length - 1)
        q = length - 1 - p
        a, b = rng.randint(1, 2**p - 1), rng.randint(1, 2**q - 1)
        return _little_endian(a, p) + (self.operator,) + _little_endian(b, q)

    def solve(self, symbols: tuple[str, ...]) -> tuple[str, ...]:
        split = symbols.index(self.operator)
        a = int("".join(reversed(symbols[:split])), 2)
        b = int("".join(reversed(symbols[split + 1 :])), 2)
        return _little_endian(self.combine(a, b))

    def combine(self, a: int, b: int) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class BinaryAddition(_BinaryOperation):
    """a + b in little-endian binary."""

    task_name: ClassVar[str] = "binary_addition"
    operator: ClassVar[str] = "+"

    def combine(self, a: int, b: int) -> int:
        return a + b


@dataclass(frozen=True)
class BinaryMultiplication(_BinaryOperation):
    """a * b in little-endian binary."""

    task_name: ClassVar[str] = "binary_multiplication"
    operator: ClassVar[str] = "*"

    def combine(self, a: int, b: int) -> int:
        return a * b


CHOMSKY_TASKS: dict[str, type[ChomskyTask]] = {
    cls.task_name: cls
    for cls in (
        EvenPairs,
        CycleNavigation,
        ModularArithmetic,
        ReverseString,
        StackManipulation,
        DuplicateString,
        BinaryAddition,
        BinaryMultiplication,
    )
}
"""Registry: task name -> its class (each also in :data:`attnlab.tasks.registry.TASKS`)."""
