"""Which calls attnlab's soft-attention kernels take: the ``applies`` predicates of the ``short``
and ``decode`` entries of :data:`attnlab.nn.attention.BACKENDS`.

Each kernel computes the same softmax(mask(scale Q K^T)) V (Vaswani Eq. 1) as PyTorch's fused
kernel and the explicit formula; a predicate says only whether it *can* take a call. Whether it is
the fastest of those that can is measured on the machine (:mod:`attnlab.kernels.calibration`):

* :func:`short_attention_applies`: short heads (a training step's), for
  :func:`attnlab.kernels.native.short_attention`, which keeps one (batch, head) in L1 at a time;
* :func:`decode_attention_applies`: a decoding step's few queries against a KV cache, for
  :func:`attnlab.kernels.native.decode_attention`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.kernels import native

__all__ = ["short_attention_applies", "decode_attention_applies"]


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
