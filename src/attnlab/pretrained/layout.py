"""A checkpoint family's tensors mapped onto attnlab's: the :class:`Family`, its :data:`Layout`, and
the filling of a model from it.

Every checkpoint attnlab opens natively is named as Hugging Face names it: a Hugging Face folder as
stored; a GGUF file after its names are renamed to Hugging Face's (:mod:`attnlab.pretrained.gguf`);
a BERT folder after its prefix is dropped (:mod:`attnlab.pretrained.bert`). One :class:`Family` per
``model_type`` then says the rest, and nothing else:

* :attr:`Family.model_section`: config.json -> the ``[model]`` section of an attnlab config
  (every key that changes the function read, or refused with one error naming it);
* :attr:`Family.layout`: config.json -> for each of attnlab's tensors, the Hugging Face tensors
  stacked along dim 0 to make it, each with the transform it needs (GPT-2 stores its maps as
  ``Conv1D``, W^T; GPT-NeoX interleaves Q, K and V per head).

The families are in :mod:`attnlab.pretrained.families` (decoders) and
:mod:`attnlab.pretrained.encoder_families` (BERT, RoBERTa). The weights fill the model one source
tensor at a time (:func:`fill_state`), checked for shape, with every tensor of the checkpoint used
exactly once or named: tensors of a safetensors file (:class:`attnlab.pretrained.checkpoint.StoredTensor`)
or tensors already in memory (:class:`HeldTensor`: a dequantized GGUF weight, a BERT file read whole).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import CheckpointError
from attnlab.pretrained.config_checks import check_stored_float
from attnlab.pretrained.integrity import check_weights

__all__ = [
    "Family",
    "Piece",
    "Layout",
    "Transform",
    "HeldTensor",
    "held",
    "check_mapped",
    "fill_state",
    "ignores",
    "layout_sources",
    "take_weights",
    "unmapped",
]

Transform = Callable[[Tensor, Mapping[str, Any]], Tensor]
"""(a checkpoint tensor, config.json) -> its rows as attnlab holds them."""


def _same(tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
    return tensor


@dataclass(frozen=True)
class Piece:
    """One Hugging Face tensor, transformed, as rows of one of attnlab's tensors."""

    name: str
    transform: Transform = _same


Layout = dict[str, tuple[Piece, ...]]
"""attnlab tensor name -> the pieces stacked (along dim 0, in order) to make it."""


@dataclass(frozen=True)
class Family:
    """One ``model_type`` of Hugging Face's, as attnlab's decoder or encoder.

    Attributes:
        name: the ``model_type``.
        model_section: (config.json, its path) -> attnlab's ``[model]`` section.
        layout: (config.json, tied embeddings?) -> :data:`Layout`.
        ignored: checkpoint tensors that are no weights of the model, shell-style patterns (saved
            buffers such as a causal mask or rotary frequencies, which attnlab computes; a BERT
            checkpoint's pooler and pre-training heads).
        zeros: attnlab tensors the family does not have, set to zero (GPT-2's output layer has
            no bias where attnlab's biased models have one: a zero bias is the same function);
            shell-style patterns (``*`` for every layer).
    """

    name: str
    model_section: Callable[[Mapping[str, Any], Path], dict[str, Any]]
    layout: Callable[[Mapping[str, Any], bool], Layout]
    ignored: tuple[str, ...] = ()
    zeros: tuple[str, ...] = ()


def ignores(name: str, ignored: tuple[str, ...]) -> bool:
    """Whether checkpoint tensor ``name`` matches one of the patterns ``ignored`` (:attr:`Family.ignored`)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ignored)


def layout_sources(layout: Layout) -> set[str]:
    """The checkpoint tensors ``layout`` takes."""
    return {piece.name for pieces in layout.values() for piece in pieces}


# ---- tensors already in memory ---------------------------------------------------------------------


@dataclass(frozen=True)
class HeldTensor:
    """A checkpoint tensor already in memory, given to :func:`fill_state` as a
    :class:`attnlab.pretrained.checkpoint.StoredTensor` is (a dequantized GGUF weight, a tensor of
    a file read whole).

    Attributes:
        name: the tensor's name in its file, as errors name it (a GGUF name such as
            ``blk.0.attn_q.weight``, where :func:`fill_state` receives it under its Hugging Face name).
        shard: the file it came from.
        tensor: its values.
    """

    name: str
    shard: Path
    tensor: Tensor

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def follows(self, other: Any) -> bool:
        """Never: tensors in memory are not stacked as one view."""
        return False

    def view(self, shape: tuple[int, ...] | None = None, *, through: Any = None) -> Tensor:
        """The tensor itself (no copy), of ``shape``."""
        return self.tensor if shape is None else self.tensor.reshape(shape)

    def read(self, out: Tensor | None = None) -> Tensor:
        """A copy of the tensor, into ``out`` where given."""
        return self.tensor.clone() if out is None else out.copy_(self.tensor.reshape(out.shape))


def held(tensors: Iterable[tuple[str, Tensor]], file: Path) -> Iterable[tuple[str, HeldTensor]]:
    """(name, tensor) pairs of ``file`` as the sources :func:`fill_state` takes."""
    return ((name, HeldTensor(name, file, tensor)) for name, tensor in tensors)


# ---- filling the model -----------------------------------------------------------------------------------


def unmapped(name: str, hf: Mapping[str, Any], where: Path) -> CheckpointError:
    """The error of a checkpoint tensor the family's layout has no place for."""
    return CheckpointError(f"{where}: tensor {name!r} is not part of a {hf.get('model_type')} model as attnlab maps it")


def check_mapped(
    names: Iterable[str], layout: Layout, hf: Mapping[str, Any], *, ignored: tuple[str, ...], where: Path
) -> None:
    """Every tensor ``names`` has a place in ``layout`` or is ``ignored``: what :func:`fill_state`
    checks as the tensors arrive, for callers that give it a part of the layout at a time.

    Raises:
        CheckpointError: the first tensor that has none (:func:`unmapped`).
    """
    owned = layout_sources(layout)
    for name in names:
        if name not in owned and not ignores(name, ignored):
            raise unmapped(name, hf, where)


def fill_state(
    sources: Iterable[tuple[str, Any]],
    expected: Mapping[str, Tensor],
    layout: Layout,
    hf: Mapping[str, Any],
    *,
    dtype: torch.dtype | None,
    ignored: tuple[str, ...],
    where: Path,
    check_values: bool = True,
    shapes_from: str = "config.json",
) -> dict[str, Tensor]:
    """attnlab's tensors from the checkpoint's, arriving one at a time.

    A target is assembled once all its pieces have arrived, in ``dtype`` (default: the stored one).
    Where it needs no change (its pieces used as stored, in the stored dtype, and stacked pieces
    adjacent in the file, as Hugging Face writes a gate projection and its up projection), it is
    a view of the file's mapping, as ``from_pretrained`` keeps its tensors: opening costs no copy.
    Otherwise its pieces are read, transformed and stacked (one copy). With ``check_values``, every
    weight's values are checked first (one pass over them; callers skip it for files checked
    before, :func:`attnlab.pretrained.provenance.values_checked`).

    Args:
        sources: (Hugging Face name, :class:`~attnlab.pretrained.checkpoint.StoredTensor` or
            :class:`HeldTensor`) pairs.
        expected: the model's state dict, or the same on the meta device (names and shapes).
        shapes_from: what the expected shapes come from, as a misfit names it.

    Raises:
        CheckpointError: a tensor missing, not part of the family's layout, repeated, of a shape
            that does not fit config.json, or with values no model has
            (:func:`attnlab.pretrained.integrity.check_weights`), named as the checkpoint names it.
    """
    inference = torch.is_inference_mode_enabled()  # thread-local: the readers take the caller's
    owner = {piece.name: (ours, index) for ours, pieces in layout.items() for index, piece in enumerate(pieces)}
    pending: dict[str, dict[int, Any]] = {}
    state: dict[str, Future[Tensor]] = {}
    seen: set[str] = set()
    fit = _Fit(where, shapes_from)
    # The reads that copy run on the intra-op threads' cores: a fresh buffer's page faults, not the
    # disk cache's bandwidth, bound one reader (GPT-2's transposed maps: 0.09 s alone on a Zen 4).
    with ThreadPoolExecutor(max_workers=max(1, torch.get_num_threads())) as readers:
        for name, stored in sources:
            if name in seen:
                raise CheckpointError(f"{where}: tensor {name!r} appears twice")
            seen.add(name)
            if name not in owner:
                if ignores(name, ignored):
                    continue
                raise unmapped(name, hf, where)
            check_stored_float(stored)  # an int8 q_proj is named, not read as floats
            if check_values:  # finite, within range (attnlab.pretrained.integrity)
                values = stored.view()
                check_weights(name, stored.read() if values is None else values, path=where)
            ours, index = owner[name]
            pieces = pending.setdefault(ours, {})
            pieces[index] = stored
            if len(pieces) == len(layout[ours]):
                parts = [pieces[i] for i in range(len(pieces))]
                as_stored = _used_as_stored(parts, layout[ours], dtype)
                if as_stored:
                    fit.check(ours, parts, [t.shape for t in parts], expected[ours])
                view = _stacked_view(parts, expected[ours]) if as_stored else None
                state[ours] = (
                    _done(view)
                    if view is not None
                    else readers.submit(
                        _read_in_mode, inference, as_stored, ours, parts, expected[ours], layout[ours], hf, dtype, fit
                    )
                )
                del pending[ours]
        missing = [piece.name for ours, pieces in layout.items() for piece in pieces if piece.name not in seen]
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing")
        return {ours: future.result() for ours, future in state.items()}


def take_weights(model: nn.Module, state: Mapping[str, Tensor]) -> None:
    """Every parameter of ``model`` takes its filled tensor (its storage, its dtype); tied
    parameters stay one. The model's own allocations were never written, so they were never resident.

    Raises:
        CheckpointError: a parameter ``state`` has no tensor for (a layout that misses it).
    """
    with torch.no_grad():
        for name, parameter in model.named_parameters():  # tied parameters appear once
            if name not in state:
                raise CheckpointError(f"no tensor for {name!r}: the family's layout misses it")
            parameter.data = state[name]


def _used_as_stored(stored: list[Any], layout: tuple[Piece, ...], dtype: torch.dtype | None) -> bool:
    """Whether a target's pieces go in untransformed and in their stored dtype."""
    return all(piece.transform is _same for piece in layout) and all(t.dtype == (dtype or t.dtype) for t in stored)


def _stacked_view(stored: list[Any], expected: Tensor) -> Tensor | None:
    """Pieces used as stored, as one view of the file's mapping where each follows the one before
    in the file (and is aligned for its dtype), else None."""
    if not all(later.follows(earlier) for earlier, later in zip(stored, stored[1:], strict=False)):
        return None
    return stored[0].view(tuple(expected.shape), through=stored[-1])


def _done(tensor: Tensor) -> Future[Tensor]:
    future: Future[Tensor] = Future()
    future.set_result(tensor)
    return future


def _read_in_mode(inference: bool, *args: Any) -> Tensor:
    with torch.inference_mode(inference):
        return _read(*args)


def _read(
    as_stored: bool,
    ours: str,
    stored: list[Any],
    expected: Tensor,
    layout: tuple[Piece, ...],
    hf: Mapping[str, Any],
    dtype: torch.dtype | None,
    fit: _Fit,
) -> Tensor:
    """The target read from the file (one copy): pieces used as stored (already checked against
    ``expected``) go straight into their rows; others are read, transformed, cast and stacked."""
    if as_stored:
        return _read_stacked(stored, expected)
    out_dtype = dtype or stored[0].dtype
    pieces = [piece.transform(t.read(), hf) for piece, t in zip(layout, stored, strict=True)]
    fit.check(ours, stored, [tuple(p.shape) for p in pieces], expected)
    if len(pieces) == 1:
        return pieces[0].to(out_dtype, memory_format=torch.contiguous_format)
    return torch.cat([p.to(out_dtype) for p in pieces], dim=0)


@dataclass(frozen=True)
class _Fit:
    """The check that a target's pieces stack to its shape, and the error that names them."""

    where: Path
    shapes_from: str

    def check(self, ours: str, stored: list[Any], shapes: list[tuple[int, ...]], expected: Tensor) -> None:
        shape = tuple(expected.shape)
        rows = sum(piece[0] if piece else 1 for piece in shapes)
        if any(tuple(p[1:]) != shape[1:] for p in shapes) or rows != (shape[0] if shape else 1):
            names = ", ".join(f"{t.name} {tuple(p)}" for t, p in zip(stored, shapes, strict=True))
            raise CheckpointError(f"{self.where}: {names} do not fit {ours} of shape {shape} from {self.shapes_from}")


def _read_stacked(stored: list[Any], expected: Tensor) -> Tensor:
    """Pieces used as stored but apart in the file (Q, K and V), read straight into their rows."""
    out = torch.empty(expected.shape, dtype=stored[0].dtype)
    row = 0
    for t in stored:
        rows = t.shape[0] if t.shape else 1
        t.read(out[row : row + rows] if out.dim() else out)
        row += rows
    return out
