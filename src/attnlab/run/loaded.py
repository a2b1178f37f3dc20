"""Opening a trained run: its config, task, tokenizer, codec and model, each verified against the
run's manifest (see :meth:`attnlab.run.directory.RunDir.read_verified`)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.devices import resolve_device
from attnlab.errors import CheckpointError, ConfigError, DataError, UsageError
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.head_ids import HeadId, held_heads, held_mask
from attnlab.kernels import native
from attnlab.nn import HeadMask, TransformerModel
from attnlab.nn.runtime_config import apply_runtime
from attnlab.run.directory import RunDir
from attnlab.run.layout import CheckpointFiles
from attnlab.runtime import release_freed_memory
from attnlab.tasks.base import Task
from attnlab.tasks.codec import TextCodec
from attnlab.tasks.registry import build_task
from attnlab.tokenizers import Tokenizer

__all__ = ["LoadedRun", "open_run", "run_experiment", "saved_tokenizer"]


@dataclass(frozen=True)
class LoadedRun:
    """A model ready to use: its config, task, codec and model (weights loaded, eval mode), from a
    run directory or opened from a pretrained checkpoint (:mod:`attnlab.pretrained.sources`)."""

    run: RunDir | None
    """The run directory; None for a model opened from a checkpoint that is no run."""
    experiment: ExperimentConfig
    task: Task
    tokenizer: Tokenizer | None
    codec: TextCodec
    model: TransformerModel
    checkpoint: CheckpointFiles | None = None
    """The checkpoint whose weights were loaded (``open_run(checkpoint=...)``); None: model.safetensors."""
    source: str = ""
    """What the model was opened from, as the user named it (a run's path, a folder, ``ORG/NAME``)."""
    outputs: Path | None = None
    """Where analyses write by default: the run, or for a checkpoint that is no run (often in the
    read-only Hugging Face cache) ``attnlab-out/NAME`` in the working directory."""
    placement: Any = None
    """Where the model's modules are (an :class:`attnlab.pretrained.placement.Placement`) when it
    was placed over devices; None: on one device."""

    @property
    def name(self) -> str:
        """A short name: the run folder's or the model's (``ORG/NAME`` as ``ORG--NAME``)."""
        if self.run is not None:
            return self.run.path.resolve().name
        return (self.source or "model").rstrip("/").replace("/", "--")

    @property
    def analysis(self) -> Path:
        """The default folder of analysis outputs (created on first use)."""
        return self.run.analysis if self.run is not None else _ensure(self._output_root / "analysis")

    @property
    def plots(self) -> Path:
        """The default folder of pictures (created on first use)."""
        return self.run.plots if self.run is not None else _ensure(self._output_root / "plots")

    @property
    def _output_root(self) -> Path:
        return self.outputs if self.outputs is not None else Path("attnlab-out") / self.name

    def tokenizer_text(self) -> str | None:
        """tokenizer.json's text (verified against the run's manifest for a run)."""
        if self.run is not None:
            return self.run.read_tokenizer_text()
        return None if self.tokenizer is None else self.tokenizer.to_json()

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


def _ensure(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return folder


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
    data = run.read_tokenizer_bytes()
    if data is None:
        return None
    try:
        return Tokenizer.from_bytes(data, source=run.tokenizer_path)
    except DataError as error:
        raise CheckpointError(str(error)) from None


def open_run(path: str | Path, *, device: str | torch.device = "cpu", checkpoint: str | None = None) -> LoadedRun:
    """Load a run directory: config.json, the task, tokenizer.json and model.safetensors, each
    verified against the run's manifest (see :meth:`attnlab.run.directory.RunDir.read_verified`);
    the model runs with the run's ``[runtime]`` attention and the kernel choices it recorded
    (kernels.json; a run with none, such as an import, takes this process's measured choices).

    Args:
        path: the run directory.
        device: where the model goes (``auto``, ``cpu``, ``cuda``, ``cuda:N`` or a
            :class:`torch.device`); its head masks follow it (:meth:`LoadedRun.held_mask`).
        checkpoint: load this checkpoint's weights instead of model.safetensors: ``last``,
            ``best`` or ``step-N`` (:meth:`attnlab.run.directory.RunDir.choose_checkpoint`).

    Raises:
        UsageError: a device name that is malformed or names a GPU this process cannot see; a
            checkpoint the run does not have (the message names --checkpoint and the available ones).
    """
    if isinstance(device, str):
        try:
            device = resolve_device(device)
        except ValueError as error:
            raise UsageError(str(error)) from None
    run = RunDir.open(path)
    chosen = None if checkpoint is None else run.choose_checkpoint(checkpoint)  # before the task is built
    experiment = run_experiment(run)
    task, tokenizer = build_task(experiment.task, saved_tokenizer=saved_tokenizer(run))
    model = model_for_task(experiment, task, to_load=True)
    if chosen is None:
        run.load_weights(model)
    else:
        run.load_checkpoint_weights(model, chosen)
    model.to(device).eval()
    recorded = run.read_kernels()  # a run trained here recorded its kernels; an imported one has none
    if recorded is None:
        model.use_attention(experiment.runtime.attention)  # kernels: this process's measured choices
    else:
        apply_runtime(model, experiment.runtime, recorded)
    native.prepare(device)  # a first use's kernel build now, before a command's progress bar
    release_freed_memory()  # the tokenizer's parse leaves freed blocks between live ones (attnlab.runtime)
    return LoadedRun(run, experiment, task, tokenizer, TextCodec(task, tokenizer), model, chosen, source=str(path))
