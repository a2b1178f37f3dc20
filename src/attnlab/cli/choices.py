"""The fixed choices of command-line options, as enums: click checks them, ``--help`` lists them and
the shell completes them.

Plain string values, so that the CLI needs no torch to show them; ``tests/unit/test_cli_imports.py``
checks that each enum matches the library's own list (``attnlab.tasks.base.SPLITS``,
``attnlab.tokenizers.KINDS``, ``attnlab.experiment.PRECISIONS``, ``attnlab.nn.ATTENTION_KINDS``,
``attnlab.bench.BENCHMARKS``).
"""

from __future__ import annotations

from enum import Enum


class Split(str, Enum):
    """A task split (:data:`attnlab.tasks.base.SPLITS`)."""

    train = "train"
    valid = "valid"
    test = "test"
    length_generalisation = "length_generalisation"


class TokenizerKind(str, Enum):
    """A tokenizer kind (:data:`attnlab.tokenizers.KINDS`)."""

    word = "word"
    rule = "rule"
    char = "char"
    wordpiece = "wordpiece"
    bpe = "bpe"


class HeadKind(str, Enum):
    """An attention kind of a model's heads (:data:`attnlab.nn.ATTENTION_KINDS`)."""

    encoder_self = "encoder_self"
    decoder_self = "decoder_self"
    cross = "cross"
    self = "self"


class Benchmark(str, Enum):
    """A benchmark of ``attnlab bench`` (:data:`attnlab.bench.BENCHMARKS`), or all of them."""

    train = "train"
    train_headmask = "train-headmask"
    decode = "decode"
    attention = "attention"
    heads = "heads"
    mfu = "mfu"
    lm = "lm"
    hf = "hf"
    sweep = "sweep"
    tl = "tl"
    bridge = "bridge"
    gpu = "gpu"
    all = "all"


class Precision(str, Enum):
    """A training precision (:data:`attnlab.experiment.PRECISIONS`)."""

    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


def value_of(choice: Enum | str | None) -> str | None:
    """The plain string of an enum choice (``None`` stays ``None``)."""
    return choice.value if isinstance(choice, Enum) else choice
