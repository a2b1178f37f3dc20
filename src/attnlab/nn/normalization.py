"""The normalizations of a residual stream: LayerNorm, RMSNorm and Gemma's RMSNorm.

* LayerNorm(a; g, b)   = g * (a - mu) / sqrt(sigma^2 + eps) + b    (Agarwal Def. 6.1; Vaswani, BERT)
* RMSNorm(a; g)        = g * a / sqrt(mean(a^2) + eps)             (Zhang & Sennrich 2019; Llama)
* RMSNorm_1+w(a; w)    = (1 + w) * a / sqrt(mean(a^2) + eps)       (Gemma; w starts at 0)

all over the last dim, row by row. RMSNorm drops the centring and the bias: Llama-family models
use it in every pre-norm block and before the output layer.

In float16 and bfloat16 the two RMSNorms compute as Hugging Face's do: RMSNorm normalises in
float32, casts back to the input's dtype, then multiplies by g (``LlamaRMSNorm``); Gemma's takes
the product with 1 + w in float32 too and casts the result back (``Gemma2RMSNorm``). float32 and
float64 inputs are computed in their own dtype.

:data:`NORMS` is the registry (``model.norm``): each entry makes the module (its parameters and
state-dict keys are those of PyTorch's ``nn.LayerNorm`` / ``nn.RMSNorm``: ``weight``, and
LayerNorm's ``bias``) and gives the functional form that :class:`attnlab.nn.layers.AddNorm`
calls on that module's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Norm", "NORMS", "make_norm", "RMSNorm", "OnePlusRMSNorm"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Norm:
    """One normalization: how to build its module and how to apply it to a module's parameters."""

    build: Callable[[int, float], nn.Module]
    apply: Callable[[nn.Module, Tensor], Tensor]


def _layer_norm(norm: nn.Module, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _normalized(x: Tensor, eps: float) -> Tensor:
    """a / sqrt(mean(a^2) + eps) in at least float32."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    if x.dtype in _HALF:  # as LlamaRMSNorm: normalise in float32, cast back, then the gain
        return norm.weight * _normalized(x, norm.eps).to(x.dtype)
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


def _rms_one_plus(norm: nn.Module, x: Tensor) -> Tensor:
    return (_normalized(x, norm.eps) * (1.0 + norm.weight.to(torch.promote_types(x.dtype, torch.float32)))).to(x.dtype)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` (the same parameter, ``weight``), computed in half precision as
    Hugging Face's Llama computes it (see the module docstring).

    Shape:
        x: (..., d) -> (..., d).
    """

    def __init__(self, d: int, eps: float) -> None:
        super().__init__(d, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return _rms_norm(self, x)


class OnePlusRMSNorm(nn.Module):
    """Gemma's RMSNorm: (1 + w) * a / sqrt(mean(a^2) + eps), w initialised to 0 (``Gemma2RMSNorm``).

    Shape:
        x: (..., d) -> (..., d).
    """

    def __init__(self, d: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x: Tensor) -> Tensor:
        return _rms_one_plus(self, x)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


NORMS: dict[str, Norm] = {
    "layer": Norm(lambda d, eps: nn.LayerNorm(d, eps=eps), _layer_norm),
    "rms": Norm(RMSNorm, _rms_norm),
    "rms_one_plus": Norm(OnePlusRMSNorm, _rms_one_plus),
}
"""Registry of normalizations: ``model.norm`` -> :class:`Norm`."""


def make_norm(name: str, d_model: int, eps: float) -> nn.Module:
    """The normalization module ``name`` over width ``d_model``."""
    if name not in NORMS:
        raise ValueError(f"norm: unknown {name!r}; allowed: {', '.join(sorted(NORMS))}")
    return NORMS[name].build(d_model, eps)
