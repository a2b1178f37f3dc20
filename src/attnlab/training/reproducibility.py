"""What makes two runs bit-equal: the thread count and the platform, set and recorded.

A run with the same config and seed repeats bit for bit at the same thread count on the same kind
of machine (CPU model, PyTorch version): the CPU kernels split their sums over threads, and another
split rounds differently (parity at 300 steps: test accuracy 0.565 on 1 thread, 0.7375 on 2).

* ``train.threads`` (0 = PyTorch's count for this process at the start: the machine's cores, or
  ``OMP_NUM_THREADS``) is resolved once, written into ``config.json`` and applied with
  :func:`torch.set_num_threads` (:func:`resolve_threads`, :func:`applied_threads`);
* every checkpoint's ``trainer_state.json`` records :func:`platform_record`;
* ``train --resume`` compares the checkpoint's record with this process's and warns once
  (:class:`~attnlab.errors.AttnlabWarning`) when they differ (:func:`warn_if_platform_differs`);
* the kernel chosen for each shape class comes from the run's :class:`~attnlab.kernels.calibration.KernelRecord`
  (:func:`run_kernels`): ``[runtime] kernels = "fixed"`` (the default) never times a kernel, so two
  runs of one config and seed give the same weights whatever else the machine does; the record is
  written into the run (``kernels.json``, in its manifest) with each checkpoint, and ``--resume``
  and ``train --like RUN`` run with the choices recorded there.
"""

from __future__ import annotations

import contextlib
import platform
import sys
import warnings
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import torch

from attnlab.errors import AttnlabWarning, UsageError
from attnlab.experiment import ExperimentConfig
from attnlab.kernels.calibration import KernelRecord
from attnlab.nn.runtime_config import apply_runtime
from attnlab.run.directory import RunDir

__all__ = [
    "run_kernels",
    "resolve_threads",
    "applied_threads",
    "platform_record",
    "platform_differences",
    "warn_if_platform_differs",
]

COMPARED = {"threads": "threads", "cpu": "CPU", "torch": "torch"}
"""The platform fields that change a run's numbers -> how a message names them."""


def resolve_threads(threads: int) -> int:
    """The thread count ``train.threads`` asks for: itself, or PyTorch's current count for 0."""
    return threads if threads > 0 else torch.get_num_threads()


@contextlib.contextmanager
def applied_threads(threads: int) -> Iterator[int]:
    """Run the block with ``torch.set_num_threads(resolve_threads(threads))``; restore the count after.

    Yields:
        the thread count in use.
    """
    before = torch.get_num_threads()
    resolved = resolve_threads(threads)
    torch.set_num_threads(resolved)
    try:
        yield resolved
    finally:
        torch.set_num_threads(before)


def platform_record(threads: int) -> dict[str, Any]:
    """What a checkpoint records about the process that wrote it."""
    return {
        "threads": threads,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


@cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s "model name", else :func:`platform.processor`)."""
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or sys.platform


def platform_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """'threads 2 -> 1'-style notes for each compared field that differs (fields missing from an old
    record are not compared)."""
    return [
        f"{name} {recorded[key]} -> {current[key]}"
        for key, name in COMPARED.items()
        if key in recorded and recorded[key] != current.get(key)
    ]


def warn_if_platform_differs(recorded: Any, current: Mapping[str, Any], *, where: str, step: int) -> None:
    """One :class:`AttnlabWarning` when the checkpoint at ``where`` (of ``step``) was written on
    another thread count, CPU model or torch version than ``current``; nothing for a checkpoint
    without a record (written before records existed)."""
    if not isinstance(recorded, Mapping):
        return
    differences = platform_differences(recorded, current)
    if differences:
        warnings.warn(
            f"{where} was trained up to step {step} with another setup ({'; '.join(differences)}): "
            f"the steps after it will not be bit-equal to an uninterrupted run's "
            f"(runs repeat bit for bit only at the same train.threads on the same CPU model and torch version)",
            AttnlabWarning,
            stacklevel=2,
        )


def run_kernels(
    model: torch.nn.Module, experiment: ExperimentConfig, run: RunDir, *, resume: bool, like: str | Path | None
) -> KernelRecord:
    """Set the run's attention setting and kernel record on ``model`` (:func:`attnlab.nn.runtime_config.apply_runtime`)
    and return the record: the one ``run`` recorded when resumed, ``like``'s (another run's, whose
    choices this run repeats), else a new one in ``[runtime] kernels``'s mode.

    Raises:
        UsageError: ``like`` is not a run, or recorded no kernel choices.
    """
    recorded = run.read_kernels() if resume else None
    if like is not None:
        recorded = RunDir.open(like).read_kernels()
        if recorded is None:
            raise UsageError(f"--like: {like} records no kernel choices (kernels.json); train it again or drop --like")
        recorded = KernelRecord(recorded.mode, recorded.choices)  # this run's own copy, written into it
        recorded.changed = True
    return apply_runtime(model, experiment.runtime, recorded)
