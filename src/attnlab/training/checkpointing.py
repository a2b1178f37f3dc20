"""The trainer's checkpoints: the run folder it writes them into, writing one, resuming from the
latest, and pointing the run back to a good one after a divergence.

A checkpoint of step s holds the model's weights and the trainer's state at s: the optimizer's
(tensors plus JSON, :mod:`attnlab.training.checkpoint`), the LR scheduler's, the data position,
the RNG states, the platform (:mod:`attnlab.training.reproducibility`), the evaluations so far and
the stop record (:mod:`attnlab.training.selection`), the weights of the best validation under
``train.select = "best_valid"`` (tensors ``selected.*``), and the validation of step s when there was
one (what ``--checkpoint best`` ranks by). Restoring all of it makes the losses after a resume
equal those of an uninterrupted run (bit for bit on the CPU). Every file goes through
:class:`attnlab.run.directory.RunDir`, which writes a checkpoint atomically.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from attnlab.errors import CheckpointError
from attnlab.kernels.calibration import KernelRecord
from attnlab.run.directory import RunDir
from attnlab.run.output_paths import check_output_path
from attnlab.training.checkpoint import optimizer_from_tensors, optimizer_to_tensors, restore_rng, rng_to_tensors
from attnlab.training.data import BatchStream, FreshStream
from attnlab.training.distributed import DistInfo
from attnlab.training.reproducibility import warn_if_platform_differs
from attnlab.training.selection import Evaluation

__all__ = [
    "Resumed",
    "run_directory",
    "remove_if_unused",
    "write_checkpoint",
    "restore_checkpoint",
    "fall_back_to_good_checkpoint",
]


def run_directory(path: Path, *, resume: bool, dist: DistInfo) -> RunDir:
    """The run to resume, or a new one (made by rank 0 only)."""
    if resume:
        return RunDir.open(path)
    if not dist.is_main:
        return RunDir(path)
    check_output_path(path, kind="run")  # before a tokenizer trains on the corpus
    return RunDir.create(path)


def remove_if_unused(run: RunDir) -> None:
    """Remove a run folder this process made if nothing but the writer's lock file was written."""
    if run.path.is_dir() and all(p.name == RunDir.LOCK for p in run.path.iterdir()):
        shutil.rmtree(run.path, ignore_errors=True)


def write_checkpoint(
    run: RunDir,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    stream: BatchStream | FreshStream,
    *,
    platform: dict[str, Any],
    history: list[Evaluation],
    stopped: dict[str, Any] | None,
    selected_weights: dict[str, torch.Tensor] | None,
    validation: dict[str, Any] | None,
    keep: int,
    kernels: KernelRecord | None = None,
) -> None:
    """Write the checkpoint of ``step``: the weights and the trainer's state (see the module docstring),
    keeping the latest ``keep`` checkpoints; first the run's kernel choices where a class was added
    since they were last written (kernels.json)."""
    if kernels is not None and kernels.changed:
        run.write_kernels(kernels)
    optimizer_tensors, optimizer_meta = optimizer_to_tensors(optimizer)
    rng_tensors, rng_meta = rng_to_tensors()
    state = {
        "optimizer": optimizer_meta,
        "scheduler": scheduler.state_dict(),
        "data": stream.state(),
        "rng": rng_meta,
        "platform": platform,
        "selection": {"history": [e.to_json() for e in history], "stopped": stopped},
    }
    selected = {f"selected.{k}": v for k, v in (selected_weights or {}).items()}
    if validation is not None and validation["step"] == step:
        state["validation"] = validation  # what --checkpoint best ranks by (attnlab.run.directory)
    run.write_checkpoint(
        step,
        model,
        {**optimizer_tensors, **rng_tensors, **selected},
        state,
        keep=keep,
    )


@dataclass(frozen=True)
class Resumed:
    """What a resume gives back besides the objects it restores in place."""

    step: int
    history: list[Evaluation]
    stopped: dict[str, Any] | None
    selected_weights: dict[str, torch.Tensor] | None


def restore_checkpoint(
    run: RunDir,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    stream: BatchStream | FreshStream,
    *,
    platform: dict[str, Any],
    main: bool,
) -> Resumed:
    """Restore the weights, optimizer, scheduler, data position and RNG states of the run's latest
    checkpoint in place; on the main process, warn when it was written on another platform and drop
    the metrics logged after it.

    Raises:
        CheckpointError: no checkpoint, or a trainer state that cannot be read.
    """
    files = run.latest_checkpoint()
    if files is None:
        raise CheckpointError(f"{run.path} has no checkpoint to resume from")
    run.load_checkpoint_weights(model, files)
    tensors, state = run.read_trainer_state(files)
    try:
        optimizer_from_tensors(optimizer, tensors, state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        stream.restore(state["data"])
        restore_rng(tensors, state["rng"])
        step = int(state["step"])
        selection = state.get("selection", {})
        history = [Evaluation.from_json(e) for e in selection.get("history", [])]
        stopped = selection.get("stopped")
        kept = {k.removeprefix("selected."): v for k, v in tensors.items() if k.startswith("selected.")}
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"trainer state in {files.directory} is corrupted: {error}") from None
    if main:
        warn_if_platform_differs(state.get("platform"), platform, where=str(files.directory), step=step)
        run.truncate_metrics(step)
    return Resumed(step, history, stopped, kept or None)


def fall_back_to_good_checkpoint(run: RunDir, step: int) -> str:
    """After a non-finite loss at step s + 1 (``step`` = s): the weights of step s gave it, so a
    checkpoint of step s is not a good one. Point the run (``--resume``, model.safetensors) back to
    the last checkpoint before it; say what is kept."""
    good = [files for files in run.checkpoints() if files.step < step]
    latest = run.latest_checkpoint()
    if latest is not None and latest.step == step:
        if not good:
            return (
                f"the only checkpoint (step {latest.step}) holds the weights that gave it, so resuming from it "
                f"would diverge again; lower train.lr and start over"
            )
        run.point_to(good[-1])
        return (
            f"the last good checkpoint (step {good[-1].step}) is kept in {run.path}, and the run points "
            f"back to it (the one of step {latest.step} holds the weights that gave the loss)"
        )
    if latest is None:
        return "no checkpoint was written yet"
    return f"the last good checkpoint (step {latest.step}) is kept in {run.path}"
