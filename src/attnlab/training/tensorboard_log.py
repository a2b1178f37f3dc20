"""Metric sinks: where the trainer sends its metrics besides ``metrics.jsonl`` (``train.log_to``).

``metrics.jsonl`` is always written (by :class:`attnlab.run.directory.RunDir`) and stays the run's record:
every command reads it, never the sinks' files. A sink is chosen once, when the trainer starts
(:func:`open_sink`), and gets three calls: :meth:`MetricSink.write` with each log line and each
evaluation as appended to metrics.jsonl, :meth:`MetricSink.attention` after each validation, and
:meth:`MetricSink.close` when training ends or fails. Only the main process (rank 0) has one.

With ``"tensorboard"`` in ``train.log_to``, :class:`TensorBoardSink` writes TensorBoard event files
into ``RUN/tensorboard/`` (``tensorboard --logdir RUN/tensorboard``) through PyTorch's
:class:`torch.utils.tensorboard.SummaryWriter`:

* every numeric value of each record as a scalar at the record's step, tagged
  ``train/<key>`` for a log line (``train/loss``, ``train/lr``, ``train/tokens_per_s`` or
  ``train/examples_per_s``, ``train/epoch``) and ``<split>/<key>`` for an evaluation
  (``valid/accuracy``, ``valid/loss``, ``length_generalisation/accuracy``, ...); TensorBoard keeps
  them as float32;
* at each validation, the attention weights of one fixed example, the first of the ``valid``
  split, as one image per attention kind (``attention/self``, ``attention/encoder_self``, ...): a
  grid with a row per layer and a column per head (:func:`attnlab.figures.kind_grid`): each
  attention module's ``pattern`` site cached with :func:`attnlab.nn.trace` in eval mode without
  gradients, under the run's held heads. Drawing it takes a fraction of a second for a small model
  and several seconds for a 12 x 12 grid of 128 tokens, at each validation.

The writer flushes after each validation and when it closes, and otherwise every two minutes
(SummaryWriter's default).

Resume: the resumed session appends a new event file to the same folder, opened with
``purge_step`` = the checkpoint's step + 1. What the interrupted session logged after its last
checkpoint (also dropped from metrics.jsonl) is then hidden by TensorBoard's readers: the Python
``EventAccumulator`` (and ``tensorboard --load_fast=false``) drops every event at or after that
step when it reads the resumed file's start marker, and the fast data server (the default) drops a
tag's points at or after each step written again, which the resumed session rewrites, as it logs
and evaluates at the same steps. The files themselves are never rewritten. A run resumed with
``"tensorboard"`` newly added has event files from the resume on only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from attnlab.devices import model_device
from attnlab.errors import ConfigError
from attnlab.evaluation.objectives import PREDICTIONS
from attnlab.figures import kind_grid
from attnlab.head_ids import KIND_TITLES
from attnlab.nn import MODELS, trace
from attnlab.tasks.batching import Batch, collate, fit_length
from attnlab.tasks.codec import TextCodec

__all__ = [
    "TENSORBOARD_FOLDER",
    "AttentionSample",
    "MetricSink",
    "NoSink",
    "TensorBoardSink",
    "attention_sample",
    "open_sink",
    "require_tensorboard",
    "sample_maps",
    "scalars_of",
]

TENSORBOARD_FOLDER = "tensorboard"
"""The run's subfolder of TensorBoard event files (``tensorboard --logdir RUN/tensorboard``)."""

INSTALL_HINT = "pip install 'attnlab[tensorboard]'"


class MetricSink(Protocol):
    """Where the trainer's metrics go besides metrics.jsonl (rank 0 only)."""

    def write(self, record: Mapping[str, Any]) -> None:
        """One record as appended to metrics.jsonl: a log line or an evaluation (with ``split``)."""

    def attention(self, step: int, model: nn.Module, head_mask: Mapping[str, Tensor] | None) -> None:
        """The model's attention after a validation at ``step``."""

    def close(self) -> None:
        """Flush and close; called once, when training ends or fails."""


class NoSink:
    """``train.log_to = ["jsonl"]``: metrics.jsonl only; writes nothing else."""

    def write(self, record: Mapping[str, Any]) -> None:
        pass

    def attention(self, step: int, model: nn.Module, head_mask: Mapping[str, Tensor] | None) -> None:
        pass

    def close(self) -> None:
        pass


def require_tensorboard() -> type:
    """PyTorch's ``SummaryWriter`` class, imported here (not at start-up: the package is optional).

    Raises:
        ConfigError: the tensorboard package is missing; the message names ``train.log_to`` and
            how to install it.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(
            f"train.log_to: 'tensorboard' needs the tensorboard package, which is not installed; {INSTALL_HINT}"
        ) from None
    return SummaryWriter


@dataclass(frozen=True)
class AttentionSample:
    """One example, batched as the model reads it in training, and the token labels of each kind.

    Attributes:
        model_kind: ``encoder_decoder``, ``encoder_classifier`` or ``decoder_only``
            (:data:`attnlab.evaluation.objectives.PREDICTIONS` runs it).
        batch: the example as a batch of one (teacher forcing: the decoder reads BOS + target).
        pad_id: the task's padding id.
        axes: attention kind -> (query tokens, key tokens).
    """

    model_kind: str
    batch: Batch
    pad_id: int
    axes: dict[str, tuple[list[str], list[str]]]


def attention_sample(
    task: Any, codec: TextCodec, *, model_kind: str, max_length: int, truncate: bool
) -> AttentionSample | None:
    """The first example of ``task``'s ``valid`` split as an :class:`AttentionSample`; None when
    the split is empty.

    Raises:
        DataError: the example is longer than ``max_length`` and ``truncate`` is off (as the
            validation itself would).
    """
    examples = task.split("valid")
    if not examples:
        return None
    example = fit_length(examples[:1], max_length, eos_id=task.eos_id, truncate=truncate)
    batch = collate(example, pad_id=task.pad_id, bos_id=task.bos_id, eos_id=task.eos_id)
    source = codec.tokens(batch.src[0].tolist()) if batch.src is not None else []
    target = codec.tokens(batch.tgt_in[0].tolist()) if batch.tgt_in is not None else []
    read = target if MODELS[model_kind][0].language_model else source  # a language model reads BOS + text
    axes = {
        "encoder_self": (source, source),
        "decoder_self": (target, target),
        "cross": (target, source),
        "self": (read, read),
    }
    return AttentionSample(model_kind, batch, task.pad_id, axes)


@torch.no_grad()
def sample_maps(
    model: nn.Module, sample: AttentionSample, head_mask: Mapping[str, Tensor] | None = None
) -> dict[str, list[np.ndarray]]:
    """The attention weights of ``sample``: kind -> one (H_l, T_q, T_k) array per layer, layer 0 first.

    The model runs in eval mode (no dropout) without gradients, under ``head_mask``; its training
    mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    try:
        with trace(model, "*.pattern") as traced:
            PREDICTIONS[sample.model_kind](model, sample.batch.to(model_device(model)), head_mask, sample.pad_id)
    finally:
        model.train(was_training)
    sites = traced.sites
    maps: dict[str, list[np.ndarray]] = {}
    for name in sorted(traced.cache, key=lambda name: (sites[name].kind, sites[name].layer)):
        maps.setdefault(str(sites[name].kind), []).append(traced.cache[name][0].float().cpu().numpy())
    return maps


def scalars_of(record: Mapping[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of a metrics.jsonl record: tag -> value.

    Every top-level number but ``step`` (booleans, text and nested tables such as
    ``accuracy_by_length`` are left out), tagged ``<split>/<key>`` for an evaluation and
    ``train/<key>`` for a log line.
    """
    prefix = record.get("split") or "train"
    return {
        f"{prefix}/{key}": float(value)
        for key, value in record.items()
        if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)
    }


class TensorBoardSink:
    """Writes scalars and attention heatmaps to TensorBoard event files (see the module docstring).

    Args:
        folder: the event files' folder (``RUN/tensorboard``); made if missing.
        sample: the example whose attention is drawn at each validation (None: no images).
        purge_step: on resume, the first step after the checkpoint: TensorBoard hides what an
            earlier session logged at or after it.
    """

    def __init__(self, folder: Path, *, sample: AttentionSample | None, purge_step: int | None = None) -> None:
        writer_class = require_tensorboard()
        self.sample = sample
        self.writer = writer_class(log_dir=str(folder), purge_step=purge_step)

    def write(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        for tag, value in scalars_of(record).items():
            self.writer.add_scalar(tag, value, step)

    def attention(self, step: int, model: nn.Module, head_mask: Mapping[str, Tensor] | None) -> None:
        if self.sample is None:
            return
        for kind, maps in sample_maps(model, self.sample, head_mask).items():
            queries, keys = self.sample.axes[kind]
            title = f"{KIND_TITLES.get(kind, kind)}, step {step} (first validation example)"
            self.writer.add_figure(f"attention/{kind}", kind_grid(maps, queries, keys, title=title), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()  # flushes


def open_sink(
    log_to: Sequence[str],
    run_path: Path,
    *,
    sample: Callable[[], AttentionSample | None] = lambda: None,
    purge_step: int | None = None,
) -> MetricSink:
    """The sink ``train.log_to`` asks for: :class:`TensorBoardSink` into ``run_path/tensorboard``
    with ``"tensorboard"`` (``sample()`` gives the example drawn at each validation), else
    :class:`NoSink` (metrics.jsonl is written by the run itself)."""
    if "tensorboard" in log_to:
        return TensorBoardSink(Path(run_path) / TENSORBOARD_FOLDER, sample=sample(), purge_step=purge_step)
    return NoSink()
