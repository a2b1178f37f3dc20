"""From a config's [task] section to a task, its tokenizer and the model it trains.

:data:`TASK_PROPERTIES` is the one table of what each task name is: the kind of task, the model
kind it trains, whether it reads text (and so needs a tokenizer), and whether that tokenizer comes
with a pretrained model instead of being trained here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnlab.errors import ConfigError
from attnlab.nn import TransformerConfig, TransformerModel, build_model, build_model_to_load
from attnlab.tasks.base import Task
from attnlab.tasks.chomsky import CHOMSKY_TASKS
from attnlab.tasks.formal import LANGUAGES
from attnlab.tasks.registry import get_task
from attnlab.tasks.seq2seq import TRANSFORMS
from attnlab.tasks.text import read_lines, read_parallel
from attnlab.tokenizers import Tokenizer, train_tokenizer

if TYPE_CHECKING:  # the config module imports this one; only its type is needed here
    from attnlab.experiment import ExperimentConfig

__all__ = [
    "TaskProperties",
    "TASK_PROPERTIES",
    "MODEL_FOR_TASK_KIND",
    "TEXT_TASK_EXTRAS",
    "TokenizerKeys",
    "TOKENIZER_KEYS",
    "build_task",
    "model_for_task",
    "model_config_for_task",
]


@dataclass(frozen=True)
class TaskProperties:
    """What a task name is, for building it and its model.

    Attributes:
        name: the name in :data:`attnlab.tasks.registry.TASKS`.
        kind: the task's ``kind`` (recognition, seq2seq, lm, embedding).
        model_kind: the model kind it trains (a key of :data:`attnlab.nn.MODELS`).
        text: reads the user's text, so it has a tokenizer (the ``tokenizer`` key, and the run's
            tokenizer.json).
        pretrained_tokenizer: its tokenizer comes with a pretrained model (``task.tokenizer`` is
            required); otherwise a text task trains one on its training file when none is given.
    """

    name: str
    kind: str
    model_kind: str
    text: bool = False
    pretrained_tokenizer: bool = False

    @property
    def trains_tokenizer(self) -> bool:
        """Whether the task may train its own tokenizer (and so takes ``tokenizer_kind`` and ``vocab_size``)."""
        return self.text and not self.pretrained_tokenizer


TASK_PROPERTIES: dict[str, TaskProperties] = {
    p.name: p
    for p in (
        *(TaskProperties(name, "recognition", "encoder_classifier") for name in LANGUAGES),
        *(TaskProperties(name, "seq2seq", "encoder_decoder") for name in TRANSFORMS),
        TaskProperties("addition", "seq2seq", "encoder_decoder"),
        *(
            TaskProperties(name, cls.kind, "encoder_classifier" if cls.kind == "classification" else "encoder_decoder")
            for name, cls in CHOMSKY_TASKS.items()
        ),
        TaskProperties("translation", "seq2seq", "encoder_decoder", text=True),
        TaskProperties("lm", "lm", "decoder_only", text=True),
        TaskProperties("sentences", "embedding", "encoder", text=True, pretrained_tokenizer=True),
        TaskProperties("pretrained_lm", "lm", "decoder_only", text=True, pretrained_tokenizer=True),
    )
}
"""Task name -> its properties; the same names as :data:`attnlab.tasks.registry.TASKS`."""

MODEL_FOR_TASK_KIND: dict[str, str] = {
    **{p.kind: p.model_kind for p in TASK_PROPERTIES.values()},
    "next_char": "decoder_only",
}
"""The model kind each kind of task trains (read off :data:`TASK_PROPERTIES`). A formal language
with ``task.formulation = "next_char"`` is of kind ``next_char``: a causal decoder-only model, as
Bhattamishra et al. (2020) used, whose output layer gives one sigmoid logit per symbol and EOS at
each position (see :mod:`attnlab.evaluation.objectives`)."""


@dataclass(frozen=True)
class TokenizerKeys:
    """The [task] keys of a text task that choose its tokenizer rather than configure the task: a
    tokenizer.json to load, or the kind and size of one to train on the training file."""

    tokenizer: str | None = None
    tokenizer_kind: str = "bpe"
    vocab_size: int = 8000


TOKENIZER_KEYS = tuple(f.name for f in dataclasses.fields(TokenizerKeys))

TEXT_TASK_EXTRAS: dict[str, tuple[str, ...]] = {
    name: ("tokenizer_kind", "vocab_size") for name, p in TASK_PROPERTIES.items() if p.trains_tokenizer
}
"""Keys text tasks take besides their own: how to build the tokenizer when none is given."""


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
    properties = TASK_PROPERTIES.get(name)
    if properties is None or not properties.text:  # an unknown name: get_task's error names it
        return get_task(name, **options), None
    keys = TokenizerKeys(**{k: options.pop(k) for k in TOKENIZER_KEYS if k in options})
    if isinstance(saved_tokenizer, Tokenizer):
        tokenizer = saved_tokenizer
    elif saved_tokenizer is not None and saved_tokenizer.exists():
        tokenizer = Tokenizer.load(saved_tokenizer)
    elif keys.tokenizer is not None:
        tokenizer = Tokenizer.load(keys.tokenizer)
    elif properties.pretrained_tokenizer:
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


def model_for_task(experiment: ExperimentConfig, task: Task, *, to_load: bool = False) -> TransformerModel:
    """The model of the experiment, sized by the task (vocabularies, classes, padding id).

    With ``to_load`` its parameters are left uninitialised, for saved weights to take their place
    (:func:`attnlab.nn.build_model_to_load`).
    """
    config = model_config_for_task(experiment, task)
    return build_model_to_load(config) if to_load else build_model(config)


def model_config_for_task(experiment: ExperimentConfig, task: Task) -> TransformerConfig:
    """The config of :func:`model_for_task`'s model, without building it (for memory estimates)."""
    wanted = MODEL_FOR_TASK_KIND[task.kind]
    if experiment.model_kind != wanted:
        formulation = getattr(task, "formulation", "classify")
        why = "" if formulation == "classify" else f" (task.formulation = {formulation!r})"
        raise ConfigError(
            f"model.kind: task {experiment.task_name!r}{why} trains a {wanted} model, not {experiment.model_kind}"
        )
    target = getattr(task, "target", None)
    decided = {
        "vocab_size": task.vocab_size,
        "tgt_vocab_size": target.vocab_size if target is not None else task.vocab_size,
        "num_classes": getattr(task, "num_classes", 2),  # recognition: in / not in the language
        "pad_id": task.pad_id,
    }
    return experiment.model_config(**decided)
