"""The task registry: a name chosen once, options checked, a task built.

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
from collections.abc import Callable
from functools import partial
from typing import Any

from attnlab.errors import ConfigError
from attnlab.nn.config import check_value_types
from attnlab.tasks.chomsky import CHOMSKY_TASKS
from attnlab.tasks.formal import LANGUAGES, RecognitionTask
from attnlab.tasks.pretrained_lm import PretrainedLMTask
from attnlab.tasks.sentences import SentencesTask
from attnlab.tasks.seq2seq import TRANSFORMS, AdditionTask, Seq2SeqTask
from attnlab.tasks.text import LMTask, TranslationTask

__all__ = ["TASKS", "get_task", "task_options", "check_task_types"]

TASKS: dict[str, Callable[..., Any]] = {
    **{name: partial(RecognitionTask, language=name) for name in LANGUAGES},
    **{name: partial(Seq2SeqTask, transform=name) for name in TRANSFORMS},
    "addition": AdditionTask,
    **CHOMSKY_TASKS,
    "translation": TranslationTask,
    "lm": LMTask,
    "sentences": SentencesTask,
    "pretrained_lm": PretrainedLMTask,
}
"""Registry: task name -> constructor taking the task's options as keywords."""

# The option that names the variant is fixed by the task name, not settable.
_FIXED = {"language", "transform"}


def task_options(name: str) -> list[str]:
    """The options ``get_task(name, ...)`` accepts."""
    return [f.name for f in dataclasses.fields(_task_class(name)) if f.name not in _FIXED]


def check_task_types(name: str, options: dict[str, Any]) -> None:
    """Reject an option of the wrong type for task ``name`` (a string for a size, a float for a
    seed), naming it as ``task.<option>``."""
    try:
        check_value_types(_task_class(name), options)
    except ValueError as error:
        raise ConfigError(f"task.{error}") from None


def _task_class(name: str) -> type:
    factory = TASKS[name]
    return factory.func if isinstance(factory, partial) else factory


def get_task(name: str, **options: Any):
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
        return TASKS[name](**options)
    except TypeError as error:  # a required option is missing
        raise ConfigError(f"task {name!r}: {error}") from None
    except ConfigError as error:  # "train_size: must be >= 0": name it as the config does
        option = str(error).partition(":")[0]
        raise ConfigError(f"task.{error}" if option in allowed else str(error)) from None
