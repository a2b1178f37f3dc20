"""Where a model runs: the device names a user gives (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and
the :class:`torch.device` each one means on this machine.

``auto`` takes the first GPU when :func:`torch.cuda.is_available`, otherwise the CPU. Every command
that runs a model resolves its ``--device`` through :func:`resolve_device`, and ``attnlab train``'s
``train.device`` too, so that a name means the same everywhere.
"""

from __future__ import annotations

import os
import re
from itertools import chain

import torch
from torch import nn

__all__ = [
    "DEVICE_NAMES",
    "cast_parameters",
    "check_device_name",
    "cpu_cores",
    "check_processes",
    "model_device",
    "resolve_device",
]

DEVICE_NAMES = "auto, cpu, cuda, cuda:N"
"""The device names :func:`resolve_device` accepts, as error messages list them."""

_NAME = re.compile(r"auto|cpu|cuda(:\d+)?")


def check_device_name(name: str) -> str:
    """``name`` when it is one of ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: any other name (``tpu``, ``cuda:x``, ``CPU``), naming the allowed ones.
    """
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise ValueError(f"unknown device {name!r}; allowed: {DEVICE_NAMES}")
    return name


def resolve_device(name: str) -> torch.device:
    """The device ``name`` means here: ``auto`` is ``cuda`` when a GPU is visible, else ``cpu``.

    Raises:
        ValueError: a malformed name, ``cuda`` without a visible GPU, or ``cuda:N`` beyond the
            GPUs this process sees.
    """
    check_device_name(name)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"{name!r} asked for, but no CUDA device is visible; use cpu or auto")
        count = torch.cuda.device_count()
        index = int(name.partition(":")[2] or 0)
        if index >= count:
            raise ValueError(
                f"{name!r} asked for, but this process sees {count} CUDA device(s): cuda:0 to cuda:{count - 1}"
            )
    return torch.device(name)


def cpu_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def check_processes(device: str, processes: int) -> None:
    """Check that ``processes`` processes of one command (``--nproc``) fit ``device``.

    Under torchrun each process on a GPU takes its own, ``cuda:LOCAL_RANK``: N processes need N
    visible GPUs, and ``cuda:N`` (one GPU for all) cannot be honoured. On the CPU each process
    needs a core of its own: more processes than cores only share them, and run slower.

    Raises:
        ValueError: more processes than cores (CPU) or GPUs, or ``cuda:N`` with more than one process.
    """
    if processes <= 1:
        return
    if not device.startswith("cuda"):
        cores = cpu_cores()
        if processes > cores:
            raise ValueError(
                f"{processes} processes on the cpu, but this process may use {cores} cores; "
                f"use --nproc {cores} or fewer"
            )
        return
    if ":" in device:
        raise ValueError(
            f"{device!r} names one GPU, but each of the {processes} processes takes its own "
            f"(cuda:0 to cuda:{processes - 1}); give cuda"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if processes > count:
        advice = f"use --nproc {count} or fewer, or the cpu" if count else "use the cpu"
        raise ValueError(f"{processes} processes on cuda need one GPU each, but this process sees {count}; {advice}")


def model_device(model: nn.Module) -> torch.device:
    """The device of ``model``'s first parameter (or buffer) that is on one (not the meta device of a
    layer offloaded to disk by transformers' dispatch; meta where all are); the CPU for a model with none."""
    meta = None
    for tensor in chain(model.parameters(), model.buffers()):
        if tensor.device.type != "meta":
            return tensor.device
        meta = tensor.device
    return torch.device("cpu") if meta is None else meta


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``model`` with its parameters in ``dtype`` (tied ones stay one); its buffers as they are.

    Unlike ``model.to(dtype)``, which casts floating buffers too, the rotary frequencies and other
    tables computed in float32 stay float32, as Hugging Face keeps them in a bf16 model.
    """
    with torch.no_grad():
        for parameter in model.parameters():  # a tied parameter appears once
            if parameter.dtype != dtype:
                parameter.data = parameter.data.to(dtype)
    return model
