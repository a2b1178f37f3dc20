"""A model's weights as the tensors a safetensors file holds, and back.

Tied tensors are stored once, their aliases in the file's metadata (:func:`state_to_tensors`);
loading names a missing, extra or mis-shaped tensor, reads older weights' keys under their new
names (:data:`RENAMED_PREFIXES`) and can put memory-mapped tensors in a model without a copy
(:func:`load_tensors_into`). A run's weights are read verified by
:meth:`attnlab.run.reading.RunReader.load_weights`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from attnlab.errors import CheckpointError
from attnlab.nn.models import optional_state_keys
from attnlab.run.storage import parse_tensors, read_bytes

__all__ = ["weights_to_tensors", "state_to_tensors", "load_weights_into", "load_tensors_into", "RENAMED_PREFIXES"]

_ALIASES_KEY = "attnlab.aliases"

RENAMED_PREFIXES: tuple[tuple[str, str], ...] = (("body.", "decoder."),)
"""State-dict prefixes renamed since weights were first written, (old, new): a decoder-only
model's stack was ``body`` until it took the name its sites have (``decoder``). Weights that hold
no key under the new prefix are read with the old one renamed (:func:`load_tensors_into`); the file
itself is never rewritten, so its manifest record still verifies."""


def weights_to_tensors(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """The state dict with tied tensors stored once; aliases go in the metadata."""
    return state_to_tensors(model.state_dict())


def state_to_tensors(state: Mapping[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """A state dict with tied tensors (one storage, offset and shape) stored once; aliases go in
    the metadata."""
    tensors: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key in seen and tensor.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = tensor
    return tensors, {"format": "pt", _ALIASES_KEY: json.dumps(aliases)}


def load_weights_into(model: nn.Module, path: Path) -> None:
    """Load a safetensors file into ``model``, unverified (for files outside a run: use
    :meth:`RunDir.load_weights` for a run's); a missing, extra or mis-shaped tensor is named."""
    tensors, metadata = parse_tensors(read_bytes(path, what="weights"), path=path, what="weights")
    load_tensors_into(model, tensors, metadata, path=path)


def load_tensors_into(
    model: nn.Module, tensors: dict[str, Tensor], metadata: Mapping[str, str], *, path: Path, assign: bool = False
) -> None:
    """Load tensors read from ``path`` into ``model``; a missing, extra or mis-shaped tensor is named.

    With ``assign`` the model's parameters and buffers take the given tensors' storage (of the
    same dtype; others are copied) instead of a copy of them: for memory-mapped tensors
    (:func:`attnlab.run.storage.map_tensors`). Tied parameters stay one parameter. Older weights'
    keys are read under their new names (:data:`RENAMED_PREFIXES`).
    """
    try:
        aliases = json.loads(metadata.get(_ALIASES_KEY, "{}"))
        if not isinstance(aliases, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError):
        raise CheckpointError(f"weights {path} have corrupted metadata") from None
    for alias, canonical in aliases.items():
        if isinstance(canonical, str) and canonical in tensors:
            tensors[alias] = tensors[canonical]
    tensors = _renamed(tensors)
    expected = model.state_dict()
    # A key that older weights lack (a record added since) keeps its reset value: not missing.
    missing = sorted(set(expected) - set(tensors) - optional_state_keys(model))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"weights {path} do not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    for name in expected:  # in the model's order, so the first mismatch named is always the same
        if name not in tensors:  # an optional record older weights lack
            continue
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(
                f"weights {path}: tensor {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(expected[name].shape)}"
            )
    if not assign:
        model.load_state_dict(tensors, strict=True)
        return
    with torch.no_grad():
        for name, held in [*model.named_parameters(), *model.named_buffers()]:
            if name in tensors:
                _take(held, tensors[name])


def _renamed(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """``tensors`` with the keys of older weights renamed by :data:`RENAMED_PREFIXES`, each prefix
    only when no key already has its new name."""
    for old, new in RENAMED_PREFIXES:
        if any(name.startswith(new) for name in tensors):
            continue
        tensors = {new + name[len(old) :] if name.startswith(old) else name: t for name, t in tensors.items()}
    return tensors


def _take(held: Tensor, tensor: Tensor) -> None:
    """Make ``held`` (a parameter or buffer) hold ``tensor``'s values, sharing its storage when it can."""
    if tensor.dtype == held.dtype and tensor.device == held.device:
        held.data = tensor
    else:
        held.copy_(tensor)
