"""What a training checkpoint holds besides the weights, as tensors plus JSON.

* the optimizer state (Adam's moments and step counts), as tensors ``optimizer.<param>.<name>``,
  with the param groups (learning rates, betas, ...) in JSON;
* the LR scheduler position;
* the RNG states: torch CPU (dropout), CUDA when present, and Python's ``random``;
* the data position: epoch and batch index, so the next batch after a resume is the one an
  uninterrupted run would have drawn.

Everything goes through :class:`attnlab.run.directory.RunDir`; nothing here touches files.
"""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import CheckpointError

__all__ = ["optimizer_to_tensors", "optimizer_from_tensors", "rng_to_tensors", "restore_rng"]


def optimizer_to_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict[str, Any]]:
    state = optimizer.state_dict()
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, values in state["state"].items():
        for name, value in values.items():
            if isinstance(value, Tensor):
                tensors[f"optimizer.{param_id}.{name}"] = value
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def optimizer_from_tensors(optimizer: torch.optim.Optimizer, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("optimizer."):
            _, param_id, name = key.split(".", 2)
            state.setdefault(int(param_id), {})[name] = value
    for param_id, values in meta.get("scalars", {}).items():
        state.setdefault(int(param_id), {}).update(values)
    groups = meta["param_groups"]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as error:
        raise CheckpointError(f"optimizer state does not fit the model: {error}") from None


def rng_to_tensors() -> tuple[dict[str, Tensor], dict[str, Any]]:
    tensors = {"rng.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{index}"] = cuda_state
    version, internal, gauss = random.getstate()
    return tensors, {"python_random": [version, list(internal), gauss]}


def restore_rng(tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    try:
        torch.set_rng_state(tensors["rng.torch"])
        cuda_states = [tensors[k] for k in sorted(tensors) if k.startswith("rng.cuda.")]
        if cuda_states and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda_states)
        version, internal, gauss = meta["python_random"]
        random.setstate((version, tuple(internal), gauss))
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"RNG state in the checkpoint is missing or corrupted: {error}") from None
