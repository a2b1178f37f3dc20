"""Which soft-attention kernel is fastest for a call's shapes on a CPU: the choices
:mod:`attnlab.nn.attention` asks about before it runs PyTorch's fused kernel.

Each choice computes the same softmax(scale Q K^T) V (Vaswani Eq. 1); only the speed differs
(the crossovers are measured in benchmarks/README.md):

* :func:`short_attention_applies`: short heads (a training step's) go to attnlab's C++ kernel
  :func:`attnlab.kernels.native.short_attention`, which keeps one (batch, head) in L1 at a time;
* :func:`explicit_is_faster`: one query over many (batch x head) rows (a decoding step at batch 16
  and up) is scored by two batched matmuls, whose cost per row is below the fused kernel's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnlab.kernels import native

__all__ = ["short_attention_applies", "explicit_is_faster", "EXPLICIT_SINGLE_QUERY_ROWS"]

EXPLICIT_SINGLE_QUERY_ROWS = 128
"""From this many (batch x head) rows, one query on a CPU is scored explicitly rather than by the
fused kernel: the crossover measured for the models' heads."""


def short_attention_applies(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> bool:
    """Whether :func:`attnlab.kernels.native.short_attention` takes this call: (B, H, T, d) float32
    heads, 2 to :data:`~attnlab.kernels.native.SHORT_ATTENTION_MAX_QUERIES` queries over at most
    :data:`~attnlab.kernels.native.SHORT_ATTENTION_MAX_KEYS` keys, on a CPU, with no mask to
    materialise and no dropout, where the kernels are built."""
    # The query count first: it turns away a decoding step (one query) in the fewest checks.
    return (
        1 < q.shape[-2] <= native.SHORT_ATTENTION_MAX_QUERIES
        and mask is None
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and q.dim() == k.dim() == v.dim() == 4
        and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and q.numel() > 0
        and 0 < k.shape[-2] <= native.SHORT_ATTENTION_MAX_KEYS
        and max(q.shape[-1], v.shape[-1]) <= native.SHORT_ATTENTION_MAX_HEAD_DIM
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and native.available()
    )


def explicit_is_faster(q: Tensor, k: Tensor, dropout_p: float) -> bool:
    """Whether soft attention without weights runs faster as its explicit formula than through the
    fused kernel: one query on a CPU over at least :data:`EXPLICIT_SINGLE_QUERY_ROWS` (batch x head)
    rows, without dropout."""
    if q.shape[-2] != 1 or dropout_p != 0.0 or q.device.type != "cpu":
        return False
    # Plain products, not torch.broadcast_shapes, whose cost per call shows on a decoding step's
    # path. The larger product is a lower bound of the broadcast one, enough for this choice.
    return max(math.prod(q.shape[:-2]), math.prod(k.shape[:-2])) >= EXPLICIT_SINGLE_QUERY_ROWS


def decode_attention_applies(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> bool:
    """Whether :func:`attnlab.kernels.native.decode_attention` takes this call: (B, H, T, d) float32
    heads on a CPU with 1 to :data:`~attnlab.kernels.native.DECODE_ATTENTION_MAX_QUERIES` queries
    (a decoding step), the same (B, H) for q, k and v, heads up to 256 wide with unit stride, a
    bool mask or none, no
    dropout and no gradient wanted, where the kernels are built."""
    # The query count first: it turns away a training step or a prompt in one check.
    return (
        q.dim() == 4
        and 0 < q.shape[-2] <= native.DECODE_ATTENTION_MAX_QUERIES
        and dropout_p == 0.0
        and q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.float32
        and k.dim() == v.dim() == 4
        and q.shape[:2] == k.shape[:2] == v.shape[:2]
        and k.shape[-2] > 0
        and max(q.shape[-1], v.shape[-1]) <= native.SHORT_ATTENTION_MAX_HEAD_DIM
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
        and (mask is None or mask.dtype == torch.bool)
        and not native.gradient_wanted(q, k, v)
        and native.available()
    )
