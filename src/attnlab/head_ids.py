"""Naming heads (``kind:layer:head``) and building head masks from such names.

Shared by training (heads held at zero while fine-tuning), evaluation from the command line,
head analysis and the viewer. A name that does not fit the model is a :class:`UsageError` that
says what the model has.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from attnlab.errors import UsageError
from attnlab.nn import HeadMask, TransformerModel

__all__ = ["HeadId", "head_ids", "parse_head", "mask_without"]


@dataclass(frozen=True, order=True)
class HeadId:
    """One attention head: its kind, layer and index."""

    kind: str
    layer: int
    head: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.layer}:{self.head}"


def head_ids(model: TransformerModel, kinds: Sequence[str] | None = None) -> list[HeadId]:
    """Every head of the model (of ``kinds`` only, when given), in (kind, layer, head) order."""
    available = {site.kind for site in model.attention_sites()}
    for kind in kinds or ():
        if kind not in available:
            raise UsageError(f"this run has no {kind!r} attention; it has: {', '.join(sorted(available))}")
    return [
        HeadId(site.kind, site.layer, head)
        for site in model.attention_sites()
        if kinds is None or site.kind in kinds
        for head in range(site.module.heads)
    ]


def parse_head(spec: str, model: TransformerModel) -> HeadId:
    """``kind:layer:head`` -> :class:`HeadId`, checked against the model (UsageError otherwise)."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].lstrip("-").isdigit() or not parts[2].lstrip("-").isdigit():
        raise UsageError(f"head {spec!r}: expected kind:layer:head, e.g. cross:0:1")
    kind, layer, head = parts[0], int(parts[1]), int(parts[2])
    sites = {(s.kind, s.layer): s.module.heads for s in model.attention_sites()}
    kinds = sorted({k for k, _ in sites})
    if kind not in kinds:
        raise UsageError(f"head {spec!r}: this run has no {kind!r} attention; it has: {', '.join(kinds)}")
    layers = sorted(layer_index for k, layer_index in sites if k == kind)
    if (kind, layer) not in sites:
        raise UsageError(f"head {spec!r}: layer {layer} is out of range; {kind} has layers 0..{layers[-1]}")
    if not 0 <= head < sites[(kind, layer)]:
        raise UsageError(f"head {spec!r}: head {head} is out of range; {kind} layer {layer} has heads 0..{sites[(kind, layer)] - 1}")
    return HeadId(kind, layer, head)


def mask_without(model: TransformerModel, off: Iterable[HeadId], *, base: HeadMask | None = None) -> dict[str, Tensor]:
    """A head mask that keeps every head (or ``base``) except those in ``off``, which are 0."""
    device = next(model.parameters()).device
    mask = {kind: torch.ones(shape, device=device) for kind, shape in model.head_mask_shapes().items()}
    for kind, tensor in (base or {}).items():
        mask[kind] = tensor.detach().clone().to(device)
    for head in off:
        mask[head.kind][head.layer, head.head] = 0.0
    return mask
