"""ExperimentConfig: the model, task and train sections of a run, from TOML plus ``--set`` overrides.

A config file has three tables::

    [task]
    name = "reverse"            # a name in attnlab.tasks.TASKS
    max_train_length = 8        # ... and that task's own options

    [model]
    kind = "encoder_decoder"    # encoder_decoder | encoder_classifier | decoder_only | encoder
    layers = 2                  # ... any field of that kind's config class, except the ones the
    d_model = 64                #     task decides (vocab_size, tgt_vocab_size, num_classes, pad_id)

    [train]
    steps = 1000                # see TrainConfig
    lr = 1e-3

    [runtime]                   # optional: how the model runs (attnlab.nn.runtime_config)
    attention = "auto"          # auto | sdpa | explicit | native
    kernels = "fixed"           # fixed (bit-reproducible) | measured (the fastest here)

``--set section.key=value`` overrides one key; the value is read as a TOML value (``3``, ``1e-3``,
``true``, ``"text"``), and as a plain string when it is not one. An unknown section or key is a
:class:`ConfigError` that lists the allowed ones. The resolved config is saved as ``config.json``.
"""

from __future__ import annotations

import dataclasses
import sys
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.errors import ConfigError, DataError, check_field_types, check_value_types
from attnlab.limits import MAX_CONFIG_INT, MAX_STEPS
from attnlab.nn import MODELS, TransformerConfig, TransformerModel, build_model, build_model_to_load
from attnlab.nn.config import RETIRED_KEYS
from attnlab.nn.runtime_config import RuntimeConfig
from attnlab.reading import read_capped
from attnlab.resources import check_split_sizes
from attnlab.tasks.base import Task
from attnlab.tasks.registry import (
    MODEL_FOR_TASK_KIND,
    TASKS,
    TEXT_TASK_EXTRAS,
    TOKENIZER_KEYS,
    TokenizerKeys,
    check_task_types,
    task_options,
)
from attnlab.tokenizers import check_build_options

SCHEDULE_NAMES = ("noam", "constant", "cosine")

LOG_TARGETS = ("jsonl", "tensorboard")
"""Where ``train.log_to`` may send the metrics: ``jsonl`` (metrics.jsonl, the run's record, always
on) and ``tensorboard`` (event files in RUN/tensorboard/, :mod:`attnlab.training.tensorboard_log`)."""

__all__ = [
    "TrainConfig",
    "ExperimentConfig",
    "TASK_DECIDES",
    "LOG_TARGETS",
    "load_experiment",
    "parse_overrides",
    "apply_overrides",
    "complete_task_section",
    "complete_model_section",
    "model_for_task",
    "model_config_for_task",
    "positions_seed",
]

TASK_DECIDES = ("vocab_size", "tgt_vocab_size", "num_classes", "pad_id")
"""Model fields set from the task, never from the config file."""

PRECISIONS = ("fp32", "bf16", "fp16")

LOSSES = ("bce", "mse")
"""``train.loss``: the keys of :data:`attnlab.evaluation.objectives.SYMBOL_LOSSES`."""

SELECT_MODES = ("last", "best_valid")
"""``train.select``: the weights the final evaluation scores (:mod:`attnlab.training.selection`)."""
EVAL_POSITIONS = ("consecutive", "randomized", "as_trained")
"""How evaluations place tokens (``train.eval_positions``): ``consecutive`` 0, 1, ..., T - 1;
``randomized``, drawn as training draws them with ``model.randomized_positions = M`` (Ruoss et al.
2023), from a generator of the evaluation's own (:func:`attnlab.evaluation.evaluate`); or
``as_trained``: randomized where the model was trained with randomized positions, else consecutive
(one config for a grid over ``model.randomized_positions``, as the paper tests its models)."""

MAX_THREADS = 1024
"""The most ``train.threads`` may ask for: more than the machine has is allowed (to repeat a run
made on a bigger machine bit for bit), unbounded is not."""


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """How to train.

    Attributes:
        steps: optimizer steps in all.
        batch_size: examples per optimizer step, over all processes together (each of N
            processes takes every N-th example of the batch), so N does not change the maths.
        lr: peak learning rate (see :mod:`attnlab.training.schedule`).
        schedule: ``noam`` (Vaswani §5.3), ``constant`` or ``cosine``.
        warmup: warm-up steps.
        beta1, beta2, eps: Adam's (Vaswani §5.3 uses 0.9, 0.98, 1e-9).
        weight_decay: decoupled weight decay (AdamW) when > 0.
        label_smoothing: epsilon_ls of Vaswani §5.4.
        clip_norm: clip the gradient norm to this; 0 turns clipping off.
        seed: seeds parameters, dropout and the data order.
        log_every, eval_every, checkpoint_every: in steps (0 = only at the end).
        keep_checkpoints: how many checkpoints to keep.
        eval_batch_size: batch size for evaluation and decoding.
        max_length: the longest sequence fed to the model; default the model's ``max_len``.
        truncate: cut longer sequences instead of rejecting them (not for recognition).
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        precision: ``fp32``, or mixed precision ``bf16`` / ``fp16`` (autocast).
        init_embeddings: a word2vec or GloVe text file; tokens found in it start from its vectors
            (Agarwal §2.2). The coverage is reported. Its width must equal the token width.
        mask_heads: heads held at zero during training and evaluation, as ``kind:layer:head``
            (Michel §2.3's xi_h = 0), e.g. to fine-tune with some heads switched off.
        threads: CPU threads for PyTorch (:func:`torch.set_num_threads`); 0 = PyTorch's count for
            the process at the start (the machine's cores, or ``OMP_NUM_THREADS``). The run's
            config.json records the resolved count: a run repeats bit for bit only at the same
            count (see :mod:`attnlab.training.reproducibility`).
        final_splits: splits scored once more after the last step, besides ``valid`` and the
            length bins of ``task.eval_lengths`` (always scored), e.g. ``["test",
            "length_generalisation"]``, what ``attnlab sweep`` sets; checked against the task's
            splits before training.
        log_to: where the metrics go: ``["jsonl"]`` (metrics.jsonl, always present: the run's
            record, which every command reads), plus ``"tensorboard"`` for TensorBoard event files
            in RUN/tensorboard/ (scalars and attention heatmaps; needs ``pip install
            'attnlab[tensorboard]'``).
        loss: the training loss of the per-symbol sigmoids of ``next_char`` recognition: ``bce``
            (binary cross-entropy) or ``mse`` (squared error, Bhattamishra et al. 2020); see
            :data:`attnlab.evaluation.objectives.SYMBOL_LOSSES`. Evaluations report the
            cross-entropy either way. Other tasks train with their softmax cross-entropy: ``mse``
            is refused there.
        stop_at_accuracy: stop once the mean accuracy over ``valid`` and the length bins of
            ``task.eval_lengths``, scored every ``eval_every`` steps, reaches this (Bhattamishra
            et al. stop at 0.999); 0 = train all ``steps``. The run records the step it stopped at.
            The mean includes the test bins, as the paper's does.
        select: which weights the end-of-training evaluation scores: ``last`` (the last step's) or
            ``best_valid`` (those of the evaluation, every ``eval_every`` steps, with the best
            ``valid`` accuracy, ties to the lower ``valid`` loss: the validation split holds
            training lengths, never a test bin); the run records the step selected and why
            (:mod:`attnlab.training.selection`). The last checkpoint keeps the last weights.
        oracle: also score every length bin at each evaluation and write, per bin, the best
            accuracy over the evaluated steps (what Bhattamishra et al. report) to RUN/oracle.json
            and as ``oracle_accuracy`` beside each bin's final result, marked as selected on the
            test bins: optimistic, never the headline figure.
        eval_positions: ``consecutive`` (0, 1, ..., T - 1, the default), ``randomized``: every
            evaluation (during training, at the end, ``attnlab eval``) places each sequence's tokens
            at a sorted random subset of [0, M) as training does with ``model.randomized_positions
            = M`` (Ruoss et al. 2023), drawn from a generator seeded from ``seed`` and the split's
            name, never from the training generator: training, and a resume, are unchanged. An
            encoder-decoder generates at the positions drawn for BOS + the reference output (the
            output's length is given, as to Ruoss et al.'s model). Needs
            ``model.randomized_positions``. Or ``as_trained``: randomized for a model trained with
            randomized positions, consecutive for one trained without.
    """

    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    schedule: str = "noam"
    warmup: int = 100
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-9
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    eval_batch_size: int = 128
    max_length: int = 0
    truncate: bool = False
    device: str = "cpu"
    precision: str = "fp32"
    init_embeddings: str = ""
    mask_heads: list[str] = field(default_factory=list)
    threads: int = 0
    final_splits: list[str] = field(default_factory=list)
    log_to: list[str] = field(default_factory=lambda: ["jsonl"])
    loss: str = "bce"
    stop_at_accuracy: float = 0.0
    select: str = "last"
    oracle: bool = False
    eval_positions: str = "consecutive"

    def __post_init__(self) -> None:
        if not isinstance(self.log_to, list):  # --set train.log_to=tensorboard: say what a list looks like
            raise ConfigError(f'train.log_to: expected a list such as ["jsonl", "tensorboard"], got {self.log_to!r}')
        try:
            check_field_types(self)
        except ValueError as error:
            raise ConfigError(f"train.{error}") from None
        for name in ("steps", "batch_size", "eval_batch_size", "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ConfigError(f"train.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "log_every", "eval_every", "checkpoint_every", "max_length", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: must be >= 0, got {getattr(self, name)}")
        if self.steps > MAX_STEPS:
            raise ConfigError(
                f"train.steps: {self.steps:,} steps, more than the cap of {MAX_STEPS:,} (attnlab.limits.MAX_STEPS)"
            )
        if self.threads > MAX_THREADS:
            raise ConfigError(f"train.threads: must be <= {MAX_THREADS} (0 = this machine's count), got {self.threads}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        _check_once("final_splits", self.final_splits)
        for name in ("label_smoothing", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}: must lie in [0, 1), got {getattr(self, name)}")
        if self.clip_norm < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ConfigError("train.clip_norm and train.weight_decay must be >= 0, train.eps > 0")
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"train.schedule: unknown {self.schedule!r}; allowed: {', '.join(SCHEDULE_NAMES)}")
        if self.eval_positions not in EVAL_POSITIONS:
            raise ConfigError(
                f"train.eval_positions: unknown {self.eval_positions!r}; allowed: {', '.join(EVAL_POSITIONS)}"
            )
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision: unknown {self.precision!r}; allowed: {', '.join(PRECISIONS)}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device: unknown {self.device!r}; allowed: cpu, cuda, cuda:N")
        _check_log_to(self.log_to)
        if self.loss not in LOSSES:
            raise ConfigError(f"train.loss: unknown {self.loss!r}; allowed: {', '.join(LOSSES)}")
        if self.select not in SELECT_MODES:
            raise ConfigError(f"train.select: unknown {self.select!r}; allowed: {', '.join(SELECT_MODES)}")
        if not 0.0 <= self.stop_at_accuracy <= 1.0:
            raise ConfigError(f"train.stop_at_accuracy: must lie in [0, 1] (0 = off), got {self.stop_at_accuracy}")
        for name, wanted in (
            ("stop_at_accuracy", self.stop_at_accuracy > 0),
            ("select", self.select != "last"),
            ("oracle", self.oracle),
        ):
            if wanted and self.eval_every == 0:
                raise ConfigError(f"train.{name}: needs evaluations during training; set train.eval_every > 0")


def _check_once(key: str, values: list[Any]) -> None:
    """Refuse a list option that names something twice (``train.<key>: 'x' is given twice``)."""
    repeated = next((value for value in values if values.count(value) > 1), None)
    if repeated is not None:
        raise ConfigError(f"train.{key}: {repeated!r} is given twice")


def _check_log_to(targets: list[Any]) -> None:
    """``train.log_to``: known names, none twice, ``jsonl`` among them (metrics.jsonl is the record).

    Raises:
        ConfigError: naming ``train.log_to`` and what is wrong.
    """
    allowed = ", ".join(LOG_TARGETS)
    for name in targets:
        if not isinstance(name, str):
            raise ConfigError(f"train.log_to: expected names ({allowed}), got {name!r}")
        if name not in LOG_TARGETS:
            raise ConfigError(f"train.log_to: unknown {name!r}; allowed: {allowed}")
    _check_once("log_to", targets)
    if "jsonl" not in targets:
        raise ConfigError(
            f'train.log_to: must include "jsonl" (metrics.jsonl is the run\'s record), got {targets!r}; '
            'e.g. ["jsonl", "tensorboard"]'
        )


@dataclass(frozen=True)
class ExperimentConfig:
    """The resolved sections of one experiment.

    Every option a section leaves out is filled in with its default on construction, so
    :meth:`to_dict` (what ``config.json`` holds) names every value the run used; a config.json
    written before an option existed still loads, with that option's default.

    Attributes:
        task: ``name`` plus that task's options.
        model: ``kind`` plus options of that kind's config class (all but :data:`TASK_DECIDES`).
        train: the training options.
        runtime: how the model runs: its attention implementation and kernel choices
            (:mod:`attnlab.nn.runtime_config`; a config.json written before it existed reads the defaults).
    """

    task: dict[str, Any]
    model: dict[str, Any]
    train: TrainConfig = field(default_factory=TrainConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        _check_task_section(self.task)
        _check_model_section(self.model)
        object.__setattr__(self, "task", complete_task_section(self.task))
        object.__setattr__(self, "model", complete_model_section(self.model))
        _check_eval_positions(self.train, self.model)

    @property
    def task_name(self) -> str:
        return str(self.task["name"])

    @property
    def task_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.task.items() if k != "name"}

    @property
    def model_kind(self) -> str:
        return str(self.model["kind"])

    @property
    def model_config_class(self) -> type[TransformerConfig]:
        """The config class of ``model.kind`` (:data:`attnlab.nn.MODELS`), whose class attributes
        say what differs between the kinds of model (``language_model``, ``reads_source_and_target``,
        ``predicts_class``, ``embeds_sentences``, ``input_extra_positions``, ...)."""
        return MODELS[self.model_kind][0]

    def model_config(self, **decided: Any) -> TransformerConfig:
        """The model config, with the values the task decides (vocabulary sizes, classes, pad)."""
        config_cls, _ = MODELS[self.model_kind]
        options = {k: v for k, v in self.model.items() if k != "kind"}
        allowed = set(config_cls.field_names())
        try:
            return config_cls(**options, **{k: v for k, v in decided.items() if k in allowed})
        except ValueError as error:
            raise ConfigError(f"model.{error}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "task": dict(self.task),
            "model": dict(self.model),
            "train": dataclasses.asdict(self.train),
            "runtime": dataclasses.asdict(self.runtime),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table of sections [task], [model], [train]; got {type(data).__name__}")
        unknown = sorted(set(data) - {"task", "model", "train", "runtime"})
        if unknown:
            raise ConfigError(f"unknown section [{unknown[0]}]; allowed: task, model, train, runtime")
        for section, value in data.items():
            if not isinstance(value, Mapping):
                raise ConfigError(f"{section}: expected a [{section}] table, got {type(value).__name__} {value!r}")
        for section in ("task", "model"):
            if section not in data:
                raise ConfigError(f"missing section [{section}]")
        train = dict(data.get("train", {}))
        allowed = [f.name for f in dataclasses.fields(TrainConfig)]
        unknown = sorted(set(train) - set(allowed))
        if unknown:
            raise ConfigError(f"train.{unknown[0]}: unknown key; allowed: {', '.join(allowed)}")
        model = {key: value for key, value in data["model"].items() if key not in RETIRED_KEYS}  # an older run's
        runtime = RuntimeConfig.from_dict(dict(data.get("runtime", {})))
        return cls(task=dict(data["task"]), model=model, train=TrainConfig(**train), runtime=runtime)

    def with_overrides(self, overrides: Sequence[str], *, flag: str = "override") -> ExperimentConfig:
        """This config with ``section.key=value`` overrides applied (``flag`` names them in errors)."""
        return ExperimentConfig.from_dict(apply_overrides(self.to_dict(), parse_overrides(overrides, flag=flag)))

    def changed_keys(self, other: ExperimentConfig, sections: Sequence[str] = ("task", "model")) -> list[str]:
        """The keys of ``sections`` whose values differ in ``other``, as ``section.key`` (sorted): what a
        resume may not change, since the saved weights and data were made with this config."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [
            f"{section}.{key}"
            for section in sections
            for key in sorted(set(mine[section]) | set(theirs[section]))
            if mine[section].get(key) != theirs[section].get(key)
        ]


def _check_eval_positions(train: TrainConfig, model: Mapping[str, Any]) -> None:
    """``train.eval_positions = "randomized"`` draws positions as training does: only for a model
    trained with randomized positions."""
    if train.eval_positions != "randomized":
        return
    if not model.get("randomized_positions"):
        raise ConfigError(
            'train.eval_positions: "randomized" draws positions as training does with model.randomized_positions '
            "= M, which this model does not set"
        )


def positions_seed(experiment: ExperimentConfig) -> int | None:
    """The seed evaluations draw randomized positions from (``train.seed``), or None for 0, 1, ..."""
    train = experiment.train
    randomized = train.eval_positions == "randomized" or (
        train.eval_positions == "as_trained" and bool(experiment.model.get("randomized_positions"))
    )
    return train.seed if randomized else None


def _check_task_section(task: Mapping[str, Any]) -> None:
    name = task.get("name")
    if name is None:
        raise ConfigError(f"task.name: missing; allowed: {', '.join(TASKS)}")
    if name not in TASKS:
        raise ConfigError(f"task.name: unknown {name!r}; allowed: {', '.join(TASKS)}")
    allowed = task_options(name) + list(TEXT_TASK_EXTRAS.get(name, ()))
    unknown = sorted(set(task) - {"name"} - set(allowed))
    if unknown:
        raise ConfigError(f"task.{unknown[0]}: unknown key for task {name!r}; allowed: {', '.join(allowed)}")
    # Checked here, before a text task reads its training file to train a tokenizer.
    keys = {k: v for k, v in task.items() if k != "name"}
    _check_tokenizer_keys({k: v for k, v in keys.items() if k in TOKENIZER_KEYS})
    check_task_types(name, {k: v for k, v in keys.items() if k not in TOKENIZER_KEYS})
    check_split_sizes(task)  # generated and held in memory before training: capped


def _check_tokenizer_keys(keys: Mapping[str, Any]) -> None:
    try:
        check_value_types(TokenizerKeys, keys)
        chosen = TokenizerKeys(**keys)
        check_build_options(chosen.tokenizer_kind, chosen.vocab_size)
    except ValueError as error:  # "kind: unknown ...", "vocab_size: must be ..."
        field, _, reason = str(error).partition(":")
        raise ConfigError(f"task.{'tokenizer_kind' if field == 'kind' else field}:{reason}") from None


def _check_model_section(model: Mapping[str, Any]) -> None:
    kind = model.get("kind")
    if kind is None:
        _check_model_keys_without_kind(model)
        raise ConfigError(f"model.kind: missing; allowed: {', '.join(MODELS)}")
    if kind not in MODELS:
        raise ConfigError(f"model.kind: unknown {kind!r}; allowed: {', '.join(MODELS)}")
    config_cls, _ = MODELS[kind]
    allowed = [name for name in config_cls.field_names() if name not in TASK_DECIDES]
    for key in model:
        if key in TASK_DECIDES:
            raise ConfigError(f"model.{key}: set by the task, not by the config")
        if key != "kind" and key not in allowed:
            raise ConfigError(f"model.{key}: unknown key for kind {kind!r}; allowed: kind, {', '.join(allowed)}")


def _check_model_keys_without_kind(model: Mapping[str, Any]) -> None:
    """Name a key that no model kind has (``model.foo: unknown key``) before saying that
    ``model.kind`` is missing: the unknown key is the more likely mistake."""
    allowed = sorted(
        {name for config_cls, _ in MODELS.values() for name in config_cls.field_names()} - set(TASK_DECIDES)
    )
    for key in model:
        if key in TASK_DECIDES:
            raise ConfigError(f"model.{key}: set by the task, not by the config")
        if key not in allowed:
            raise ConfigError(f"model.{key}: unknown key; allowed: kind, {', '.join(allowed)}")


def complete_task_section(task: Mapping[str, Any]) -> dict[str, Any]:
    """A checked [task] section with every option it leaves out set to its default (the task
    class's, or :class:`TokenizerKeys`' for the tokenizer keys); an option without a default (a
    text task's ``train_file``) stays out, for :func:`attnlab.tasks.registry.build_task` to ask for."""
    name = task["name"]
    defaults = _field_defaults(TASKS[name].task_class)
    defaults.update(_field_defaults(TokenizerKeys))
    keys = task_options(name) + list(TEXT_TASK_EXTRAS.get(name, ()))
    complete = {"name": name}
    for key in keys:
        if key in task:
            complete[key] = task[key]
        elif key in defaults:
            complete[key] = defaults[key]
    return complete


def complete_model_section(model: Mapping[str, Any]) -> dict[str, Any]:
    """A checked [model] section with every field of its kind's config class (but the ones the
    task decides) present, at its default when the section leaves it out."""
    config_cls, _ = MODELS[model["kind"]]
    defaults = _field_defaults(config_cls)
    complete = {"kind": model["kind"]}
    for name in config_cls.field_names():
        if name not in TASK_DECIDES:
            complete[name] = model[name] if name in model else defaults[name]
    return complete


def _field_defaults(cls: type) -> dict[str, Any]:
    """Field name -> default value of dataclass ``cls``, for the fields that have one."""
    defaults = {}
    for item in dataclasses.fields(cls):
        if item.default is not dataclasses.MISSING:
            defaults[item.name] = item.default
        elif item.default_factory is not dataclasses.MISSING:
            defaults[item.name] = item.default_factory()
    return defaults


def parse_overrides(overrides: Sequence[str], *, flag: str = "override") -> list[tuple[str, str, Any]]:
    """``section.key=value`` strings -> (section, key, value) with TOML-typed values; a malformed one
    is a ConfigError that names it after ``flag`` (the CLI passes ``--set``)."""
    parsed = []
    for item in overrides:
        path, sep, raw = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"{flag} {item!r}: expected section.key=value, e.g. train.steps=100")
        parsed.append((section, key, _toml_value(raw.strip(), where=f"{flag} {path.strip()}")))
    return parsed


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[tuple[str, str, Any]]) -> dict[str, Any]:
    """Copy ``data`` with the overrides set; a section that is not a table is left for
    :meth:`ExperimentConfig.from_dict` to reject with its name."""
    merged = {section: dict(values) if isinstance(values, Mapping) else values for section, values in data.items()}
    for section, key, value in overrides:
        target = merged.setdefault(section, {})
        if isinstance(target, dict):
            target[key] = value
    return merged


def _toml_value(raw: str, *, where: str) -> Any:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw
    except ValueError:  # Python's limit on the digits of an int ("Exceeds the limit (4300 digits)")
        raise ConfigError(f"{where}: {_TOO_LONG}") from None


_TOO_LONG = (
    f"a number of more than {sys.get_int_max_str_digits():,} digits, too large for any key "
    f"(integers lie within +-{MAX_CONFIG_INT:,}, attnlab.limits.MAX_CONFIG_INT)"
)
"""What a config or ``--set`` value too long for Python to read as an int is told."""


def load_experiment(path: str | Path, overrides: Sequence[str] = (), *, flag: str = "override") -> ExperimentConfig:
    """Read a TOML config file and apply ``--set`` overrides.

    A ``[sweep]`` table (a grid and seeds for ``attnlab sweep``, :func:`attnlab.sweep.plan.sweep_table`)
    is not part of the experiment: the file's base config is read without it.
    """
    path = Path(path)
    try:
        data = tomllib.loads(read_capped(path).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as error:  # a folder, no permission
        raise ConfigError(f"{path}: cannot read the config: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    except DataError:  # past the size cap of a text input: already names the file
        raise
    except ValueError:  # Python's limit on the digits of an int
        raise ConfigError(f"{path}: {_TOO_LONG}") from None
    data.pop("sweep", None)
    return ExperimentConfig.from_dict(apply_overrides(data, parse_overrides(overrides, flag=flag)))


# ---- the model of an experiment --------------------------------------------------------------
# Here, above both the model (attnlab.nn) and the tasks: the experiment's [model] section, sized by
# its task, is the one place they meet.


def model_for_task(experiment: ExperimentConfig, task: Task, *, to_load: bool = False) -> TransformerModel:
    """The model of the experiment, sized by the task (vocabularies, classes, padding id).

    With ``to_load`` its parameters are left uninitialised, for saved weights to take their place
    (:func:`attnlab.nn.build_model_to_load`).
    """
    config = model_config_for_task(experiment, task)
    return build_model_to_load(config) if to_load else build_model(config)


def model_config_for_task(experiment: ExperimentConfig, task: Task) -> TransformerConfig:
    """The config of :func:`model_for_task`'s model, without building it (for memory estimates).

    Raises:
        ConfigError: ``model.kind`` is not the kind the task trains
            (:data:`attnlab.tasks.registry.MODEL_FOR_TASK_KIND`).
    """
    wanted = MODEL_FOR_TASK_KIND[task.kind]
    if experiment.model_config_class is not MODELS[wanted][0]:  # the config class the task trains
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
