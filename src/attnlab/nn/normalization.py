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

Each norm is also written in two parts, for the named sites ``scale`` and ``normalized``
(:mod:`attnlab.nn.hooks`; TransformerLens's ``ln.hook_scale`` and ``ln.hook_normalized``):

    scale = sqrt(mean(c^2) + eps)   (B, T, 1),     normalized = c / scale,     output = gain(normalized)

with c = a - mu for LayerNorm and c = a for the RMSNorms, computed in at least float32, and gain
g * n + b, g * n or (1 + w) * n. :meth:`Norm.run` takes that route only when one of the two sites
is hooked; otherwise it is the one fused call above.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn.hooks import Hook, run_hooks

__all__ = ["Norm", "NORMS", "make_norm", "RMSNorm", "OnePlusRMSNorm"]

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Norm:
    """One normalization: how to build its module and how to apply it to a module's parameters.

    Attributes:
        build: (width, eps) -> the module.
        apply: (module, x) -> the normalised x, in one fused call.
        centred: whether it subtracts the mean (LayerNorm) before scaling.
        gain: (module, normalized, dtype) -> the output in ``dtype``, from the normalised input.
    """

    build: Callable[[int, float], nn.Module]
    apply: Callable[[nn.Module, Tensor], Tensor]
    centred: bool
    gain: Callable[[nn.Module, Tensor, torch.dtype], Tensor]

    def run(
        self,
        module: nn.Module,
        x: Tensor,
        hooks: dict[str, list[Hook]],
        points: tuple[str, str] = ("scale", "normalized"),
    ) -> Tensor:
        """The norm of ``x``, through the hooks of its two sites ``points`` (scale, normalized) when
        either is hooked, else the fused :attr:`apply`.

        Shape:
            x: (..., d) -> (..., d);  the scale site (..., 1), the normalized one (..., d).
        """
        scale_point, normalized_point = points
        if scale_point not in hooks and normalized_point not in hooks:
            return self.apply(module, x)
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        centred = wide - wide.mean(-1, keepdim=True) if self.centred else wide
        scale = run_hooks(hooks, scale_point, torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + module.eps))
        normalized = run_hooks(hooks, normalized_point, centred / scale)
        return self.gain(module, normalized, x.dtype)


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


def _layer_gain(norm: nn.Module, normalized: Tensor, dtype: torch.dtype) -> Tensor:
    return (normalized * norm.weight + norm.bias).to(dtype)


def _rms_gain(norm: nn.Module, normalized: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype in _HALF:  # as LlamaRMSNorm: cast back, then the gain
        return norm.weight * normalized.to(dtype)
    return (normalized * norm.weight).to(dtype)


def _one_plus_gain(norm: nn.Module, normalized: Tensor, dtype: torch.dtype) -> Tensor:
    return (normalized * (1.0 + norm.weight.to(normalized.dtype))).to(dtype)


NORMS: dict[str, Norm] = {
    "layer": Norm(lambda d, eps: nn.LayerNorm(d, eps=eps), _layer_norm, True, _layer_gain),
    "rms": Norm(RMSNorm, _rms_norm, False, _rms_gain),
    "rms_one_plus": Norm(OnePlusRMSNorm, _rms_one_plus, False, _one_plus_gain),
}
"""Registry of normalizations: ``model.norm`` -> :class:`Norm`."""


def make_norm(name: str, d_model: int, eps: float) -> nn.Module:
    """The normalization module ``name`` over width ``d_model``."""
    if name not in NORMS:
        raise ValueError(f"norm: unknown {name!r}; allowed: {', '.join(sorted(NORMS))}")
    return NORMS[name].build(d_model, eps)
