"""Running one attention module under a head mask, with its pattern and z read through hooks."""

from __future__ import annotations

from typing import NamedTuple

import torch

from attnlab.nn import MultiHeadAttention, masking_heads, trace


class Attended(NamedTuple):
    output: torch.Tensor
    weights: torch.Tensor  # the pattern site
    head_outputs: torch.Tensor  # the z site


def attend(mha: MultiHeadAttention, *args, head_mask=None, **kwargs) -> Attended:  # noqa: ANN001, ANN002, ANN003
    """The module's output under the head mask, with its pattern and z (traced, graph kept)."""
    with masking_heads(mha, head_mask), trace(mha, ["attn.pattern", "attn.z"], detach=False) as traced:
        output = mha(*args, **kwargs)
    return Attended(output, traced.cache["attn.pattern"], traced.cache["attn.z"])


def masked(mha: MultiHeadAttention, *args, head_mask=None, **kwargs) -> torch.Tensor:  # noqa: ANN001, ANN002, ANN003
    """The module's output under the head mask, on the fused path."""
    with masking_heads(mha, head_mask):
        return mha(*args, **kwargs)
