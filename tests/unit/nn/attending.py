"""Running one attention module under a head mask, with its pattern and z read through hooks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnlab.nn import MultiHeadAttention, capture, masking_heads


class Attended(NamedTuple):
    output: torch.Tensor
    weights: torch.Tensor  # the pattern site
    head_outputs: torch.Tensor  # the z site


def attend(mha: MultiHeadAttention, *args, head_mask=None, **kwargs) -> Attended:  # noqa: ANN001, ANN002, ANN003
    """The module's output under the head mask, with its pattern and z (captured, graph kept)."""
    with masking_heads(mha, head_mask), capture(mha, detach=False) as records:
        output = mha(*args, **kwargs)
    return Attended(output, records[0].weights, records[0].head_outputs)


def masked(mha: MultiHeadAttention, *args, head_mask=None, **kwargs) -> torch.Tensor:  # noqa: ANN001, ANN002, ANN003
    """The module's output under the head mask, on the fused path."""
    with masking_heads(mha, head_mask):
        return mha(*args, **kwargs)
