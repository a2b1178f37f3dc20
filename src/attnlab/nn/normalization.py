"""The two normalizations of a residual stream: LayerNorm and RMSNorm.

* LayerNorm(a; g, b) = g * (a - mu) / sqrt(sigma^2 + eps) + b      (Agarwal Def. 6.1; Vaswani, BERT)
* RMSNorm(a; g)      = g * a / sqrt(mean(a^2) + eps)               (Zhang & Sennrich 2019; Llama)

both over the last dim (d_model), row by row. RMSNorm drops the centring and the bias: Llama-family
models use it in every pre-norm block and before the output layer.

:data:`NORMS` is the registry (``model.norm = "layer" | "rms"``): each entry makes the module (its
parameters and state-dict keys are PyTorch's ``nn.LayerNorm`` / ``nn.RMSNorm``) and gives the
functional form that :class:`attnlab.nn.layers.AddNorm` calls on that module's parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Norm", "NORMS", "make_norm"]


@dataclass(frozen=True)
class Norm:
    """One normalization: how to build its module and how to apply it to a module's parameters."""

    build: Callable[[int, float], nn.Module]
    apply: Callable[[nn.Module, Tensor], Tensor]


def _layer_norm(norm: nn.Module, x: Tensor) -> Tensor:
    return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def _rms_norm(norm: nn.Module, x: Tensor) -> Tensor:
    return F.rms_norm(x, norm.normalized_shape, norm.weight, norm.eps)


NORMS: dict[str, Norm] = {
    "layer": Norm(lambda d, eps: nn.LayerNorm(d, eps=eps), _layer_norm),
    "rms": Norm(lambda d, eps: nn.RMSNorm(d, eps=eps), _rms_norm),
}
"""Registry of normalizations: ``model.norm`` -> :class:`Norm`."""


def make_norm(name: str, d_model: int, eps: float) -> nn.Module:
    """The normalization module ``name`` over width ``d_model`` (a LayerNorm or an RMSNorm)."""
    if name not in NORMS:
        raise ValueError(f"norm: unknown {name!r}; allowed: {', '.join(sorted(NORMS))}")
    return NORMS[name].build(d_model, eps)
