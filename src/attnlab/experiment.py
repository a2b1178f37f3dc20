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

``--set section.key=value`` overrides one key; the value is read as a TOML value (``3``, ``1e-3``,
``true``, ``"text"``), and as a plain string when it is not one. An unknown section or key is a
:class:`ConfigError` that lists the allowed ones. The resolved config is saved as ``config.json``.
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab.errors import CheckpointError, ConfigError, DataError, UsageError
from attnlab.head_ids import HeadId, held_heads, held_mask
from attnlab.nn import MODELS, HeadMask, TransformerConfig, TransformerModel, build_model
from attnlab.nn.config import check_field_types, check_value_types  # the same type rules as the model configs
from attnlab.resources import check_split_sizes
from attnlab.runs import RunDir
from attnlab.tasks.base import Vocab
from attnlab.tasks.registry import TASKS, check_task_types, get_task, task_options
from attnlab.tasks.text import read_lines, read_parallel
from attnlab.tokenizers import Tokenizer, check_build_options, train_tokenizer

SCHEDULE_NAMES = ("noam", "constant", "cosine")

__all__ = [
    "TrainConfig",
    "ExperimentConfig",
    "TASK_DECIDES",
    "load_experiment",
    "parse_overrides",
    "build_task",
    "model_for_task",
    "model_config_for_task",
    "TextCodec",
    "LoadedRun",
    "open_run",
    "run_experiment",
]

TASK_DECIDES = ("vocab_size", "tgt_vocab_size", "num_classes", "pad_id")
"""Model fields set from the task, never from the config file."""

PRECISIONS = ("fp32", "bf16", "fp16")

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

    def __post_init__(self) -> None:
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
        if self.threads > MAX_THREADS:
            raise ConfigError(f"train.threads: must be <= {MAX_THREADS} (0 = this machine's count), got {self.threads}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr: must be > 0, got {self.lr}")
        for name in ("label_smoothing", "beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ConfigError(f"train.{name}: must lie in [0, 1), got {getattr(self, name)}")
        if self.clip_norm < 0 or self.weight_decay < 0 or self.eps <= 0:
            raise ConfigError("train.clip_norm and train.weight_decay must be >= 0, train.eps > 0")
        if self.schedule not in SCHEDULE_NAMES:
            raise ConfigError(f"train.schedule: unknown {self.schedule!r}; allowed: {', '.join(SCHEDULE_NAMES)}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision: unknown {self.precision!r}; allowed: {', '.join(PRECISIONS)}")
        if not (self.device == "cpu" or self.device == "cuda" or self.device.startswith("cuda:")):
            raise ConfigError(f"train.device: unknown {self.device!r}; allowed: cpu, cuda, cuda:N")


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
    """

    task: dict[str, Any]
    model: dict[str, Any]
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        _check_task_section(self.task)
        _check_model_section(self.model)
        object.__setattr__(self, "task", complete_task_section(self.task))
        object.__setattr__(self, "model", complete_model_section(self.model))

    @property
    def task_name(self) -> str:
        return str(self.task["name"])

    @property
    def task_options(self) -> dict[str, Any]:
        return {k: v for k, v in self.task.items() if k != "name"}

    @property
    def model_kind(self) -> str:
        return str(self.model["kind"])

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
        return {"task": dict(self.task), "model": dict(self.model), "train": dataclasses.asdict(self.train)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExperimentConfig:
        if not isinstance(data, Mapping):
            raise ConfigError(f"expected a table of sections [task], [model], [train]; got {type(data).__name__}")
        unknown = sorted(set(data) - {"task", "model", "train"})
        if unknown:
            raise ConfigError(f"unknown section [{unknown[0]}]; allowed: task, model, train")
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
        return cls(task=dict(data["task"]), model=dict(data["model"]), train=TrainConfig(**train))

    def with_overrides(self, overrides: Sequence[str]) -> ExperimentConfig:
        return ExperimentConfig.from_dict(apply_overrides(self.to_dict(), parse_overrides(overrides)))


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
    _check_tokenizer_keys({k: v for k, v in keys.items() if k in _TOKENIZER_KEYS})
    check_task_types(name, {k: v for k, v in keys.items() if k not in _TOKENIZER_KEYS})
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
    allowed = sorted({name for config_cls, _ in MODELS.values() for name in config_cls.field_names()} - set(TASK_DECIDES))
    for key in model:
        if key in TASK_DECIDES:
            raise ConfigError(f"model.{key}: set by the task, not by the config")
        if key not in allowed:
            raise ConfigError(f"model.{key}: unknown key; allowed: kind, {', '.join(allowed)}")


def complete_task_section(task: Mapping[str, Any]) -> dict[str, Any]:
    """A checked [task] section with every option it leaves out set to its default (the task
    class's, or :class:`TokenizerKeys`' for the tokenizer keys); an option without a default (a
    text task's ``train_file``) stays out, for :func:`build_task` to ask for."""
    name = task["name"]
    defaults = _field_defaults(TASKS[name].func if hasattr(TASKS[name], "func") else TASKS[name])
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


@dataclass(frozen=True)
class TokenizerKeys:
    """The [task] keys of a text task that choose its tokenizer rather than configure the task: a
    tokenizer.json to load, or the kind and size of one to train on the training file."""

    tokenizer: str | None = None
    tokenizer_kind: str = "bpe"
    vocab_size: int = 8000


_TOKENIZER_KEYS = tuple(f.name for f in dataclasses.fields(TokenizerKeys))

TEXT_TASK_EXTRAS: dict[str, tuple[str, ...]] = {
    "translation": ("tokenizer_kind", "vocab_size"),
    "lm": ("tokenizer_kind", "vocab_size"),
}
"""Keys text tasks take besides their own: how to build the tokenizer when none is given."""


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, str, Any]]:
    """``section.key=value`` strings -> (section, key, value) with TOML-typed values."""
    parsed = []
    for item in overrides:
        path, sep, raw = item.partition("=")
        section, dot, key = path.strip().partition(".")
        if not sep or not dot or not key:
            raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.steps=100")
        parsed.append((section, key, _toml_value(raw.strip())))
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


def _toml_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """Read a TOML config file and apply ``--set`` overrides."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except OSError as error:  # a folder, no permission
        raise ConfigError(f"{path}: cannot read the config: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    return ExperimentConfig.from_dict(apply_overrides(data, parse_overrides(overrides)))


# ---- from a config to a task and a model ------------------------------------------------------

TEXT_TASKS = ("translation", "lm", "sentences")

MODEL_FOR_TASK_KIND = {
    "recognition": "encoder_classifier",
    "seq2seq": "encoder_decoder",
    "lm": "decoder_only",
    "embedding": "encoder",
}
"""The model kind each kind of task trains."""


def build_task(
    section: Mapping[str, Any], *, saved_tokenizer: Tokenizer | Path | None = None
) -> tuple[Any, Tokenizer | None]:
    """The task of a [task] section, and its tokenizer for text tasks.

    A text task's tokenizer is, in order: the run's saved ``tokenizer.json`` (``saved_tokenizer``,
    when resuming or evaluating: a Tokenizer already read, see :func:`saved_tokenizer`, or a path), the file named by ``task.tokenizer``, or one trained on the
    training file (``task.tokenizer_kind``, default ``bpe``; ``task.vocab_size``, default 8000).
    The ``sentences`` task reads a pretrained encoder's tokenizer, so it never trains one.
    """
    options = {k: v for k, v in section.items() if k != "name"}
    name = section["name"]
    if name not in TEXT_TASKS:
        return get_task(name, **options), None
    keys = TokenizerKeys(**{k: options.pop(k) for k in _TOKENIZER_KEYS if k in options})
    kind, vocab_size, tokenizer_path = keys.tokenizer_kind, keys.vocab_size, keys.tokenizer
    if isinstance(saved_tokenizer, Tokenizer):
        tokenizer = saved_tokenizer
    elif saved_tokenizer is not None and saved_tokenizer.exists():
        tokenizer = Tokenizer.load(saved_tokenizer)
    elif tokenizer_path is not None:
        tokenizer = Tokenizer.load(tokenizer_path)
    elif name in PRETRAINED_TOKENIZER_TASKS:
        raise ConfigError(f"task.tokenizer: required for task {name!r} (the pretrained model's tokenizer.json)")
    else:
        if "train_file" not in options:
            raise ConfigError(f"task.train_file: required for task {name!r}")
        tokenizer = train_tokenizer(kind, _corpus(name, options), vocab_size)
    return get_task(name, tokenizer=tokenizer, **options), tokenizer


PRETRAINED_TOKENIZER_TASKS = ("sentences",)
"""Text tasks whose tokenizer comes with a pretrained model and is never trained here."""


def _corpus(name: str, options: Mapping[str, Any]) -> list[str]:
    reader_options = {k: options[k] for k in ("max_line_chars", "skip_bad_lines") if k in options}
    try:
        if name == "translation":
            pairs = read_parallel(options["train_file"], **reader_options).items
            return [side for pair in pairs for side in pair]
        return list(read_lines(options["train_file"], **reader_options).items)
    except ConfigError as error:  # "max_line_chars: must be >= 1": a [task] key
        raise ConfigError(f"task.{error}") from None


def model_for_task(experiment: ExperimentConfig, task: Any) -> TransformerModel:
    """The model of the experiment, sized by the task (vocabularies, classes, padding id)."""
    return build_model(model_config_for_task(experiment, task))


def model_config_for_task(experiment: ExperimentConfig, task: Any) -> TransformerConfig:
    """The config of :func:`model_for_task`'s model, without building it (for memory estimates)."""
    wanted = MODEL_FOR_TASK_KIND[task.kind]
    if experiment.model_kind != wanted:
        raise ConfigError(
            f"model.kind: task {experiment.task_name!r} trains a {wanted} model, not {experiment.model_kind}"
        )
    target = getattr(task, "target", None)
    decided = {
        "vocab_size": task.vocab_size,
        "tgt_vocab_size": target.vocab_size if target is not None else task.vocab_size,
        "num_classes": 2,
        "pad_id": task.pad_id,
    }
    return experiment.model_config(**decided)


class TextCodec:
    """Text <-> token ids for a task: its tokenizer (text tasks) or its symbol vocabulary.

    Synthetic tasks write one symbol per character ("abc", "12+5", "(()())"); symbols may also be
    separated by spaces ("a b c"). A task with a ``frame`` (the ``sentences`` task: BERT's
    ``[CLS] ... [SEP]``) puts the tokenizer's ids in it; the others take them as they are.
    """

    def __init__(self, task: Any, tokenizer: Tokenizer | None) -> None:
        self.task, self.tokenizer = task, tokenizer
        self._frame = FRAMES.get(getattr(task, "kind", ""), _unframed)(task)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self._frame(self.tokenizer.encode(text))
        vocab: Vocab = self.task.vocab
        symbols = text.split() if " " in text.strip() else list(text.strip())
        allowed = vocab.tokens[3:]
        for symbol in symbols:
            if symbol not in allowed:
                raise UsageError(f"input {text!r}: symbol {symbol!r} is not in the task's alphabet {' '.join(allowed)}")
        return list(vocab.encode(tuple(symbols)))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return getattr(self.task, "target", self.tokenizer).decode(ids)
        return "".join(self.task.vocab.tokens[i] for i in ids)

    def vocabulary(self) -> dict[str, int]:
        """token text -> id, specials excluded (what word vectors can be looked up by)."""
        if self.tokenizer is not None:
            specials = set(self.tokenizer.special_ids.values())
            return {t: i for t, i in self.tokenizer.vocab.items() if i not in specials}
        return {t: i for i, t in enumerate(self.task.vocab.tokens) if i >= 3}

    def tokens(self, ids: list[int]) -> list[str]:
        """One label per id (for plots and the viewer)."""
        if self.tokenizer is not None:
            return [self.tokenizer.id_to_token(i) or "?" for i in ids]
        return [self.task.vocab.tokens[i] for i in ids]


def _unframed(task: Any) -> Any:
    return list


FRAMES: dict[str, Any] = {"embedding": lambda task: task.frame}
"""Task kind -> (task -> the function that puts a text's token ids into the model's input frame)."""


@dataclass(frozen=True)
class LoadedRun:
    """A trained run, ready to use: its config, task, codec and model (weights loaded, eval mode)."""

    run: RunDir
    experiment: ExperimentConfig
    task: Any
    tokenizer: Tokenizer | None
    codec: TextCodec
    model: TransformerModel

    @property
    def held_heads(self) -> list[HeadId]:
        """The heads ``train.mask_heads`` held at zero in training (Michel §2.3's xi_h = 0)."""
        return held_heads(self.model, self.experiment.train.mask_heads)

    def held_mask(self, off: Iterable[HeadId] = (), *, base: HeadMask | None = None) -> dict[str, Tensor] | None:
        """The head mask to run this model with: the held heads and ``off`` at 0, on top of ``base``.

        The run's model *is* the model with its held heads off (they never trained), so evaluation,
        decoding, attention maps and head analysis all start from this mask; None when nothing is
        masked. See :func:`attnlab.head_ids.held_mask`.
        """
        return held_mask(self.model, self.experiment.train.mask_heads, off, base=base)


def run_experiment(run: RunDir) -> ExperimentConfig:
    """The experiment a run was made with, from its config.json; an error names that file."""
    try:
        return ExperimentConfig.from_dict(run.read_config())
    except ConfigError as error:
        raise ConfigError(f"{run.path / RunDir.CONFIG}: {error}") from None


def saved_tokenizer(run: RunDir) -> Tokenizer | None:
    """The run's tokenizer.json, verified against its manifest; None when the run has none.

    Raises:
        CheckpointError: the file is damaged or not a tokenizer; the message names it.
    """
    text = run.read_tokenizer_text()
    if text is None:
        return None
    try:
        return Tokenizer.from_str(text, source=run.tokenizer_path)
    except DataError as error:
        raise CheckpointError(str(error)) from None


def open_run(path: str | Path, *, device: str = "cpu") -> LoadedRun:
    """Load a run directory: config.json, the task, tokenizer.json and model.safetensors, each
    verified against the run's manifest (see :meth:`attnlab.runs.RunDir.read_verified`)."""
    run = RunDir.open(path)
    experiment = run_experiment(run)
    task, tokenizer = build_task(experiment.task, saved_tokenizer=saved_tokenizer(run))
    model = model_for_task(experiment, task)
    run.load_weights(model)
    model.to(device).eval()
    return LoadedRun(run, experiment, task, tokenizer, TextCodec(task, tokenizer), model)
