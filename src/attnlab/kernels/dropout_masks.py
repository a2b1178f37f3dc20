"""Dropout, with the mask drawn from uniform random integers on a CPU.

    Dropout_p(x) = x * m / (1 - p),   m_i ~ Bernoulli(1 - p)   (Vaswani §5.4: on every sub-layer output
                                                               and on the embedding sums)

Off the CPU, :func:`dropout` is PyTorch's ``F.dropout``, one fused kernel on the device. On a CPU,
PyTorch draws its mask from a serial Mersenne twister, which made dropout a visible part of a
training step; attnlab draws its own masks there, measurably faster (benchmarks/README.md).

On a CPU, entry i is kept when a uniform random word u_i of b bits is at least t = round(p 2^b). The rate
realised is therefore t / 2^b (:func:`realised_rate`), and the scale is 1 / (1 - t / 2^b), so that
E[Dropout_p(x)] = x exactly:

* rates of at least 2^-7 use 16-bit words: the rate is within 2^-17 of p, 0.1% of p at worst
  (p = 0.1 drops 0.1000061). Four words come from one 64-bit draw.
* smaller rates use 32-bit words (within 2^-33 of p).

A float32 ``rand() >= p`` resolves p to 2^-24, and noise in a 16-bit input's own dtype (bfloat16 has
256 levels in [0, 1)) would keep a visibly wrong fraction; the words never depend on the input's dtype.

The words come from NumPy's PCG64, seeded from torch's default generator on every call, so
``torch.manual_seed`` (and a run's saved RNG state) fixes every mask. For float32 tensors the C++
kernels of :mod:`attnlab.kernels.native`, where they are built, draw the same PCG64 words on all
cores and write the scaled mask in one pass (:func:`scaled_keep_mask`): the same masks, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.kernels import native

__all__ = ["Dropout", "dropout", "keep_mask", "scaled_keep_mask", "realised_rate", "signed_threshold", "word_bits"]

SHORT_WORD_MIN_RATE = 2**-7
"""Rates from this one up are resolved with 16-bit words (to 0.1% of the rate or better)."""


class Dropout(nn.Module):
    """Inverted dropout with rate ``p``; the identity in eval mode or when p = 0.

    Shape:
        x: any shape -> the same shape.
    """

    def __init__(self, p: float = 0.0) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout: must lie in [0, 1), got {p}")
        self.p = p

    def forward(self, x: Tensor) -> Tensor:
        return dropout(x, self.p, self.training)

    def extra_repr(self) -> str:
        return f"p={self.p}"


def dropout(x: Tensor, p: float, training: bool) -> Tensor:
    """The function behind :class:`Dropout`, for modules that apply it on a hot path without a
    sub-module call: ``F.dropout`` off the CPU, attnlab's masks on a CPU."""
    if not training or p == 0.0:
        return x
    if x.device.type != "cpu":
        return F.dropout(x, p, training=True)
    return x * scaled_keep_mask(x, p)


def scaled_keep_mask(x: Tensor, p: float) -> Tensor:
    """m / (1 - realised rate) for a CPU tensor like ``x``: the factor dropout multiplies ``x`` by.

    For a float32 tensor the kernels of :mod:`attnlab.kernels.native` draw the words and write the
    scaled mask in one parallel pass; the same mask, bit for bit, as :func:`keep_mask` scaled.
    """
    scale = 1.0 / (1.0 - realised_rate(p))
    if x.dtype == torch.float32 and native.available():
        bits = word_bits(p)
        return native.scaled_keep_mask(
            x.shape, seed=_numpy_seed(), bits=bits, threshold=signed_threshold(p), scale=scale
        )
    # m / (1 - p) built in place on the mask: one temporary and two passes fewer than
    # `x * mask.to(dtype) * scale`, which the forward and backward both feel (benchmarks/README.md).
    return keep_mask(x.shape, p).to(x.dtype).mul_(scale)


def word_bits(p: float) -> int:
    """Bits b of the random words that decide a drop at rate ``p``: 16, or 32 below 2^-7."""
    return 16 if p >= SHORT_WORD_MIN_RATE else 32


def realised_rate(p: float) -> float:
    """The rate a mask for ``p`` drops at: round(p 2^b) / 2^b, b = :func:`word_bits` (p)."""
    levels = 2 ** word_bits(p)
    return _threshold(p, levels) / levels


def keep_mask(shape: torch.Size | tuple[int, ...], p: float) -> Tensor:
    """A boolean CPU tensor of ``shape`` whose entries are independently True with probability
    1 - :func:`realised_rate` (p), from PCG64 words seeded by torch's default CPU generator.

    Random words u_i are uniform on [0, 2^b); viewed as signed b-bit integers they are uniform on
    [-2^(b-1), 2^(b-1)), and u_i >= t holds for 2^b - t of the 2^b values.
    """
    return _numpy_words(shape, word_bits(p)).ge(signed_threshold(p))


def signed_threshold(p: float) -> int:
    """The signed word a mask for ``p`` keeps from: round(p 2^b) - 2^(b-1), b = :func:`word_bits` (p)."""
    bits = word_bits(p)
    signed_min = torch.iinfo(_SIGNED[bits]).min  # -2^(b-1): where word 0 lands in the signed view
    return _threshold(p, 2**bits) + signed_min


def _threshold(p: float, levels: int) -> int:
    return min(round(p * levels), levels - 1)  # p < 1: at least one word value keeps


_SIGNED = {16: torch.int16, 32: torch.int32}


def _numpy_words(shape: torch.Size | tuple[int, ...], bits: int) -> Tensor:
    """CPU words from NumPy's PCG64, seeded by one draw from torch's CPU generator."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(shape, dtype=_SIGNED[bits])  # (NumPy's empty draw has stride 0: no view)
    per_draw = 64 // bits
    draws = np.random.PCG64(_numpy_seed()).random_raw(-(-count // per_draw))  # uint64, each split into per_draw words
    return torch.from_numpy(draws).view(_SIGNED[bits])[:count].view(shape)


def _numpy_seed() -> int:
    """One draw from torch's CPU generator (so ``torch.manual_seed`` fixes it) to seed a mask's PCG64."""
    return int(torch.empty((), dtype=torch.int64).random_())
