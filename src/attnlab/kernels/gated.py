"""Elementwise steps of Llama-family layers in one pass where that is the same function and
faster: SwiGLU's gate, SiLU(gate) * up, and the rotation of queries and keys by their positions.

    FFN_SwiGLU(x) = (SiLU(x W_gate) * (x W_up)) W_2               (Shazeer 2020, Eq. 6)

PyTorch computes SiLU(gate) into a tensor of its own and multiplies it by up: two passes over the
largest activations of a Llama-family layer. attnlab's C++ kernel (:func:`attnlab.kernels.native.swiglu`)
reads each half once and writes the product once; it has no backward, so it takes only calls that
need no gradient (inference, decoding, prefill). The same holds for rotary embeddings
(:func:`attnlab.kernels.native.rotary`: one pass where PyTorch's ops take five).

The predicates here say only whether a kernel *can* take a call; whether it is faster than
PyTorch's ops for the call's shape class on this machine is measured once
(:mod:`attnlab.kernels.calibration`, asked by :func:`attnlab.nn.feed_forward.swiglu` and
:mod:`attnlab.nn.rotary`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnlab.kernels import native

__all__ = ["fused_swiglu_applies", "fused_rotary_applies"]


def fused_swiglu_applies(hidden: Tensor) -> bool:
    """Whether :func:`attnlab.kernels.native.swiglu` takes ``hidden`` ([gate, up] side by side):
    see :func:`_inference_rows_on_cpu`."""
    return _inference_rows_on_cpu(hidden)


def fused_rotary_applies(x: Tensor, cos: Tensor) -> bool:
    """Whether :func:`attnlab.kernels.native.rotary` takes ``x`` (queries or keys, (B, H, T, d))
    with float32 angles ``cos``: see :func:`_inference_rows_on_cpu`."""
    return x.dim() == 4 and cos.dtype == torch.float32 and _inference_rows_on_cpu(x)


def _inference_rows_on_cpu(x: Tensor) -> bool:
    """float32 on a CPU, not empty, unit stride in the last dim, no gradient wanted, outside
    autocast, where the kernels are built: what the one-pass kernels take."""
    return (
        x.dtype == torch.float32
        and x.device.type == "cpu"
        and not native.gradient_wanted(x)
        and x.numel() > 0
        and x.stride(-1) == 1
        and not torch.is_autocast_enabled("cpu")
        and native.available()
    )
