"""Head masks xi for whole models (Michel §2.3), one tensor per attention kind.

A :data:`HeadMask` maps an attention kind to a float tensor of shape (layers, heads), or
(B, layers, heads) for a different mask per example. Entry [l, h] multiplies the output of head h
of layer l before W^O. Values are 0/1 for ablation, or real-valued with ``requires_grad`` so that
dL/dxi_h gives head importance (Michel §3). A kind left out is not masked.

Attention kinds:

* ``encoder_self``: encoder self-attention of an encoder-decoder;
* ``decoder_self``: masked decoder self-attention of an encoder-decoder;
* ``cross``: encoder-decoder attention;
* ``self``: the self-attention of a decoder-only model or an encoder classifier.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

__all__ = ["HeadMask", "ATTENTION_KINDS", "check_head_mask", "kind_mask", "full_head_mask"]

HeadMask = Mapping[str, Tensor]
ATTENTION_KINDS = ("encoder_self", "decoder_self", "cross", "self")


def check_head_mask(head_mask: HeadMask | None, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Raise ``ValueError`` naming the kind when ``head_mask`` does not fit a model of ``shapes``."""
    if head_mask is None:
        return
    for kind, tensor in head_mask.items():
        if kind not in shapes:
            raise ValueError(f"head_mask: this model has no {kind!r} attention; it has: {', '.join(shapes)}")
        expected = shapes[kind]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise ValueError(f"head_mask[{kind!r}] must be a float tensor of shape {expected} or (B, *{expected})")
        if tuple(tensor.shape[-2:]) != expected or tensor.dim() not in (2, 3):
            raise ValueError(
                f"head_mask[{kind!r}] has shape {tuple(tensor.shape)}; expected (layers, heads) = {expected} "
                f"or (B, {expected[0]}, {expected[1]})"
            )


def kind_mask(head_mask: HeadMask | None, kind: str) -> Tensor | None:
    """The (layers, heads) or (B, layers, heads) mask of one kind, or None when it is not masked."""
    return None if head_mask is None else head_mask.get(kind)


def full_head_mask(
    shapes: Mapping[str, tuple[int, int]],
    value: float = 1.0,
    *,
    batch: int | None = None,
    requires_grad: bool = False,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """A head mask filled with ``value`` for every kind in ``shapes`` (all-ones keeps every head)."""
    lead = () if batch is None else (batch,)
    return {
        kind: torch.full((*lead, *shape), value, device=device, requires_grad=requires_grad)
        for kind, shape in shapes.items()
    }
