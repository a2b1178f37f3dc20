"""The task registry: one entry per task name, saying how to build the task and what it is (its
kind, the model kind it trains, whether it reads text and so has a tokenizer); a [task] section
built into a task and its tokenizer (:func:`build_task`).

=============  ==============================================  ===================
name           what                                            model
=============  ==============================================  ===================
parity         even number of 1s (Hahn §3 recognition)         EncoderClassifier
dyck1, dyck2   balanced brackets, one or two kinds              EncoderClassifier
anbn, anbncn   a^n b^n, a^n b^n c^n                             EncoderClassifier
copy           output = input                                  EncoderDecoder
reverse        output = input reversed                         EncoderDecoder
sort           output = input sorted                           EncoderDecoder
addition       a + b, digits as tokens                         EncoderDecoder
translation    parallel TSV files                              EncoderDecoder
even_pairs, cycle_navigation, modular_arithmetic
               Delétang et al. 2023, regular: one class         EncoderClassifier
reverse_string, stack_manipulation, duplicate_string, binary_addition, binary_multiplication
               Delétang et al. 2023, DCF and CS: a sequence     EncoderDecoder
lm             plain text                                      DecoderOnly
sentences      texts for a sentence encoder (BERT input)       EncoderOnly
pretrained_lm  text for a pretrained causal LM (Llama)         DecoderOnly
=============  ==============================================  ===================
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from attnlab.errors import ConfigError, check_value_types
from attnlab.tasks.base import Task
from attnlab.tasks.chomsky import CHOMSKY_TASKS
from attnlab.tasks.formal import LANGUAGES, RecognitionTask
from attnlab.tasks.pretrained_lm import PretrainedLMTask
from attnlab.tasks.pretrained_seq2seq import PretrainedSeq2SeqTask
from attnlab.tasks.sentences import SentencesTask
from attnlab.tasks.seq2seq import TRANSFORMS, AdditionTask, Seq2SeqTask
from attnlab.tasks.text import LMTask, TranslationTask, read_lines, read_parallel
from attnlab.tokenizers import Tokenizer, train_tokenizer

__all__ = [
    "TaskEntry",
    "TASKS",
    "MODEL_FOR_TASK_KIND",
    "TokenizerKeys",
    "TOKENIZER_KEYS",
    "TEXT_TASK_EXTRAS",
    "get_task",
    "task_options",
    "check_task_types",
    "build_task",
]

MODEL_FOR_TASK_KIND: dict[str, str] = {
    "recognition": "encoder_classifier",
    "classification": "encoder_classifier",
    "seq2seq": "encoder_decoder",
    "lm": "decoder_only",
    "embedding": "encoder",
    "next_char": "decoder_only",
}
"""The model kind (a key of :data:`attnlab.nn.MODELS`) each kind of task trains. A formal language
with ``task.formulation = "next_char"`` is of kind ``next_char``: a causal decoder-only model, as
Bhattamishra et al. (2020) used, whose output layer gives one sigmoid logit per symbol and EOS at
each position (see :mod:`attnlab.evaluation.objectives`)."""


@dataclass(frozen=True)
class TaskEntry:
    """One task name: how to build its task, and what the task is.

    Attributes:
        name: the name a config's ``task.name`` gives.
        build: the constructor, taking the task's options as keywords.
        text: reads the user's text, so it has a tokenizer (the ``tokenizer`` key, and the run's
            tokenizer.json).
        pretrained_tokenizer: its tokenizer comes with a pretrained model (``task.tokenizer`` is
            required); otherwise a text task trains one on its training file when none is given.
    """

    name: str
    build: Callable[..., Task]
    text: bool = False
    pretrained_tokenizer: bool = False

    @property
    def task_class(self) -> type:
        """The class ``build`` makes (a ``partial`` fixes the language or transform of a family)."""
        return self.build.func if isinstance(self.build, partial) else self.build  # type: ignore[return-value]

    @property
    def kind(self) -> str:
        """The task's kind (recognition, classification, seq2seq, lm, embedding), its class's."""
        return str(self.task_class.kind)

    @property
    def model_kind(self) -> str:
        """The model kind it trains (:data:`MODEL_FOR_TASK_KIND` of its kind)."""
        return MODEL_FOR_TASK_KIND[self.kind]

    @property
    def trains_tokenizer(self) -> bool:
        """Whether the task may train its own tokenizer (and so takes ``tokenizer_kind`` and ``vocab_size``)."""
        return self.text and not self.pretrained_tokenizer


TASKS: dict[str, TaskEntry] = {
    entry.name: entry
    for entry in (
        *(TaskEntry(name, partial(RecognitionTask, language=name)) for name in LANGUAGES),
        *(TaskEntry(name, partial(Seq2SeqTask, transform=name)) for name in TRANSFORMS),
        TaskEntry("addition", AdditionTask),
        *(TaskEntry(name, cls) for name, cls in CHOMSKY_TASKS.items()),
        TaskEntry("translation", TranslationTask, text=True),
        TaskEntry("lm", LMTask, text=True),
        TaskEntry("sentences", SentencesTask, text=True, pretrained_tokenizer=True),
        TaskEntry("pretrained_lm", PretrainedLMTask, text=True, pretrained_tokenizer=True),
        TaskEntry("pretrained_seq2seq", PretrainedSeq2SeqTask, text=True, pretrained_tokenizer=True),
    )
}
"""Registry: task name -> its entry."""

# The option that names the variant is fixed by the task name, not settable.
_FIXED = {"language", "transform"}


@dataclass(frozen=True)
class TokenizerKeys:
    """The [task] keys of a text task that choose its tokenizer rather than configure the task: a
    tokenizer.json to load, or the kind and size of one to train on the training file."""

    tokenizer: str | None = None
    tokenizer_kind: str = "bpe"
    vocab_size: int = 8000


TOKENIZER_KEYS = tuple(f.name for f in dataclasses.fields(TokenizerKeys))

TEXT_TASK_EXTRAS: dict[str, tuple[str, ...]] = {
    name: ("tokenizer_kind", "vocab_size") for name, entry in TASKS.items() if entry.trains_tokenizer
}
"""Keys text tasks take besides their own: how to build the tokenizer when none is given."""


def task_options(name: str) -> list[str]:
    """The options ``get_task(name, ...)`` accepts."""
    return [f.name for f in dataclasses.fields(TASKS[name].task_class) if f.name not in _FIXED]


def check_task_types(name: str, options: dict[str, Any]) -> None:
    """Reject an option of the wrong type for task ``name`` (a string for a size, a float for a
    seed), naming it as ``task.<option>``."""
    try:
        check_value_types(TASKS[name].task_class, options)
    except ValueError as error:
        raise ConfigError(f"task.{error}") from None


def get_task(name: str, **options: Any) -> Task:
    """Build task ``name`` with ``options``.

    Raises:
        ConfigError: an unknown task name or option; the message lists the allowed ones.
    """
    if name not in TASKS:
        raise ConfigError(f"task: unknown task {name!r}; choose one of {', '.join(TASKS)}")
    allowed = task_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(f"task.{unknown[0]}: unknown option for {name!r}; allowed: {', '.join(allowed)}")
    check_task_types(name, options)  # before the task compares them to its bounds
    try:
        return TASKS[name].build(**options)
    except TypeError as error:  # a required option is missing
        raise ConfigError(f"task {name!r}: {error}") from None
    except ConfigError as error:  # "train_size: must be >= 0": name it as the config does
        option = str(error).partition(":")[0]
        raise ConfigError(f"task.{error}" if option in allowed else str(error)) from None


def build_task(
    section: Mapping[str, Any], *, saved_tokenizer: Tokenizer | Path | None = None
) -> tuple[Task, Tokenizer | None]:
    """The task of a [task] section, and its tokenizer for text tasks.

    A text task's tokenizer is, in order: the run's saved ``tokenizer.json`` (``saved_tokenizer``,
    when resuming or evaluating: a Tokenizer already read, see
    :func:`attnlab.run.loaded.saved_tokenizer`, or a path), the file named by ``task.tokenizer``, or
    one trained on the training file (``task.tokenizer_kind``, default ``bpe``; ``task.vocab_size``,
    default 8000). The ``sentences`` task reads a pretrained encoder's tokenizer, so it never trains one.
    """
    options = {k: v for k, v in section.items() if k != "name"}
    name = section["name"]
    entry = TASKS.get(name)
    if entry is None or not entry.text:  # an unknown name: get_task's error names it
        return get_task(name, **options), None
    keys = TokenizerKeys(**{k: options.pop(k) for k in TOKENIZER_KEYS if k in options})
    if isinstance(saved_tokenizer, Tokenizer):
        tokenizer = saved_tokenizer
    elif saved_tokenizer is not None and saved_tokenizer.exists():
        tokenizer = Tokenizer.load(saved_tokenizer)
    elif keys.tokenizer is not None:
        tokenizer = Tokenizer.load(keys.tokenizer)
    elif entry.pretrained_tokenizer:
        raise ConfigError(f"task.tokenizer: required for task {name!r} (the pretrained model's tokenizer.json)")
    else:
        if "train_file" not in options:
            raise ConfigError(f"task.train_file: required for task {name!r}")
        tokenizer = train_tokenizer(keys.tokenizer_kind, _corpus(name, options), keys.vocab_size)
    return get_task(name, tokenizer=tokenizer, **options), tokenizer


def _corpus(name: str, options: Mapping[str, Any]) -> list[str]:
    reader_options = {k: options[k] for k in ("max_line_chars", "skip_bad_lines") if k in options}
    try:
        if name == "translation":
            pairs = read_parallel(options["train_file"], **reader_options).items
            return [side for pair in pairs for side in pair]
        return list(read_lines(options["train_file"], **reader_options).items)
    except ConfigError as error:  # "max_line_chars: must be >= 1": a [task] key
        raise ConfigError(f"task.{error}") from None
