"""Queries and keys normalised after their projection, before rotary positions (Qwen3, Gemma 3, OLMo 2).

A variant of :class:`attnlab.nn.multi_head.MultiHeadAttention` chosen once in its ``__init__`` from
:data:`QK_NORMS` (``model.qk_norm``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

__all__ = ["QK_NORMS", "QKNorm", "NormFn"]

NormFn = Callable[[nn.Module, Tensor], Tensor]


def _unnormalized(apply: NormFn, norm: nn.Module | None, x: Tensor, d_k: int) -> Tensor:
    """No q/k norm: the projection as it is."""
    return x


def _per_head(apply: NormFn, norm: nn.Module | None, x: Tensor, d_k: int) -> Tensor:
    """Norm over d_k on each head, one gain of size d_k shared by the heads (Qwen3, Gemma 3).

    Shape:
        x: (B, T, heads*d_k) -> (B, T, heads*d_k).
    """
    return apply(norm, x.unflatten(-1, (-1, d_k))).flatten(-2)  # type: ignore[arg-type]


def _whole(apply: NormFn, norm: nn.Module | None, x: Tensor, d_k: int) -> Tensor:
    """Norm over the whole projection, every head's d_k together (OLMo 2)."""
    return apply(norm, x)  # type: ignore[arg-type]


def _same_gain(parameter: Tensor, rows: Tensor) -> Tensor:
    return parameter.detach().clone()


def _gain_rows(parameter: Tensor, rows: Tensor) -> Tensor:
    return parameter.detach()[rows]


@dataclass(frozen=True)
class QKNorm:
    """One way of normalising queries and keys after their projection, before rotary positions.

    Attributes:
        widths: (heads, kv_heads, d_k) -> the widths of the query and key norms; None for no norm.
        apply: ``(norm_fn, norm_module, x, d_k) -> x`` on a projection (B, T, heads*d_k).
        subset: ``(parameter, rows) -> parameter`` of a norm restricted to the kept heads' rows.
    """

    widths: Callable[[int, int, int], tuple[int, int]] | None
    apply: Callable[[NormFn, nn.Module | None, Tensor, int], Tensor]
    subset: Callable[[Tensor, Tensor], Tensor] = _same_gain


QK_NORMS: dict[str, QKNorm] = {
    "none": QKNorm(None, _unnormalized),
    "head": QKNorm(lambda heads, kv_heads, d_k: (d_k, d_k), _per_head),
    "full": QKNorm(lambda heads, kv_heads, d_k: (heads * d_k, kv_heads * d_k), _whole, _gain_rows),
}
"""Registry of q/k norms (``model.qk_norm``): ``none``; ``head``, Norm over d_k on each head of q and
of k (Qwen3, Gemma 3); ``full``, Norm over the whole H*d_k query projection and the whole
H_kv*d_k key projection (OLMo 2). The norm's kind is the model's ``norm``."""
