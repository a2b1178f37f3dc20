"""Score functions f_att(q_i, k_j) of multi-head attention, one small module each, in a registry.

Hahn §3 Eq. (1) leaves the score open: a_ij = f_att(y_i, y_j), "for example, using dot product or
additive attention". Each score here acts on the *per-head* projected queries and keys, after the
W^Q, W^K projections of :class:`attnlab.nn.multi_head.MultiHeadAttention`:

=============  ====================================================  ==========================
name           score e_ij for head h                                  source
=============  ====================================================  ==========================
scaled_dot     q_i . k_j / sqrt(d_k)                                  Vaswani Eq. 1
dot            q_i . k_j                                              Vaswani §3.2.1
bilinear       q_i^T W_h k_j / sqrt(d_k)                              Luong; Michel §2.1
additive       w_h^T tanh(q_i + k_j)                                  Bahdanau; Li's slides
=============  ====================================================  ==========================

For ``additive`` the W_q q_i + W_k k_j of Bahdanau are the head's own query and key projections
(a composition of linear maps is linear), so only the vector w_h is new.

Every score exposes the same three things to :func:`attnlab.nn.attention.attention`:
``prepare(q, k)`` (a cheap transform of queries/keys), ``scale`` and ``score_fn``. Dot-product
kinds leave ``score_fn`` as ``None`` and so run on the fused SDPA kernel; ``bilinear`` does too,
because q^T W k = (q^T W) k. Only ``additive`` needs explicit (T_q, T_k) scores.

Soft-capping (Gemma 2) bounds scores, or logits, to (-c, c) smoothly: :func:`soft_cap`,
c tanh(e / c). On attention scores it is applied after the scale and before the mask, by
:class:`attnlab.nn.multi_head.MultiHeadAttention` through a score function, so it runs on the
explicit attention formula (the fused kernels take no score function).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attnlab.nn.attention_backends import ScoreFn

__all__ = [
    "AttentionScore",
    "ScaledDotScore",
    "DotScore",
    "BilinearScore",
    "AdditiveScore",
    "SCORES",
    "make_score",
    "soft_cap",
]

# Elements of one chunk of the (T_q, T_k, d_k) tanh tensor of additive scores.
_ADDITIVE_CHUNK_ELEMENTS = 2**24


class AttentionScore(nn.Module):
    """Base class. Subclasses set ``scale`` and may override ``prepare`` and ``score_fn``.

    Every parameter of a score has the head axis first, so that heads can be selected (pruned)
    by indexing it.

    Shape (for all methods):
        q: (B, H, T_q, d_k);  k: (B, H, T_k, d_k);  scores: (B, H, T_q, T_k).
    """

    scale: float = 1.0
    score_fn: ScoreFn | None = None

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return q, k

    def forward(self, q: Tensor, k: Tensor) -> Tensor:
        """The explicit score matrix (used by references and analysis)."""
        q, k = self.prepare(q, k)
        if self.score_fn is not None:
            return self.score_fn(q, k)
        return torch.matmul(q, k.transpose(-2, -1)) * self.scale


class ScaledDotScore(AttentionScore):
    """e_ij = q_i . k_j / sqrt(d_k)  (Vaswani §3.2.1, Eq. 1)."""

    def __init__(self, *, heads: int, d_k: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(d_k)


class DotScore(AttentionScore):
    """e_ij = q_i . k_j, unscaled dot-product ("multiplicative") attention (Vaswani §3.2.1)."""

    def __init__(self, *, heads: int, d_k: int) -> None:
        super().__init__()
        self.scale = 1.0


class BilinearScore(AttentionScore):
    """e_ij = q_i^T W_h k_j / sqrt(d_k), scaled bilinear attention (Luong et al.; Michel §2.1).

    W_h starts as the identity, so an untrained bilinear score equals ``scaled_dot``.

    Attributes:
        weight: (H, d_k, d_k), one matrix W_h per head.
    """

    def __init__(self, *, heads: int, d_k: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(d_k)
        self.weight = nn.Parameter(torch.eye(d_k).repeat(heads, 1, 1))  # (H, d_k, d_k)

    def prepare(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return torch.matmul(q, self.weight), k  # (B, H, T_q, d_k) @ (H, d_k, d_k): q_i^T W_h


class AdditiveScore(AttentionScore):
    """e_ij = w_h^T tanh(q_i + k_j), additive attention (Bahdanau et al.; Li's slides, "alignment model").

    Computed in query chunks so the (T_q, T_k, d_k) tanh tensor never exists whole in the forward
    pass; the backward pass still keeps O(T_q T_k d_k) activations (Vaswani §3.2.1: "dot-product
    attention is much faster and more space-efficient in practice").

    Attributes:
        weight: (H, d_k), one vector w_h per head.
    """

    def __init__(self, *, heads: int, d_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(heads, d_k) / math.sqrt(d_k))  # (H, d_k)
        self.score_fn = self._additive_scores

    def _additive_scores(self, q: Tensor, k: Tensor) -> Tensor:
        t_q, t_k, d_k = q.shape[-2], k.shape[-2], q.shape[-1]
        lead = math.prod(torch.broadcast_shapes(q.shape[:-2], k.shape[:-2]))
        chunk = max(1, _ADDITIVE_CHUNK_ELEMENTS // max(1, lead * t_k * d_k))
        w = self.weight.to(q.dtype)[:, None, None, :]  # (H, 1, 1, d_k), against (..., H, c, T_k, d_k)
        pieces = []
        for start in range(0, t_q, chunk):
            q_chunk = q[..., start : start + chunk, :]
            hidden = torch.tanh(q_chunk.unsqueeze(-2) + k.unsqueeze(-3))  # (B, H, c, T_k, d_k)
            pieces.append((hidden * w).sum(-1))  # (B, H, c, T_k)
        return torch.cat(pieces, dim=-2)


SCORES: dict[str, type[AttentionScore]] = {
    "scaled_dot": ScaledDotScore,
    "dot": DotScore,
    "bilinear": BilinearScore,
    "additive": AdditiveScore,
}
"""Registry of score functions: name -> class taking ``heads`` and ``d_k`` keywords."""


def make_score(name: str, *, heads: int, d_k: int) -> AttentionScore:
    """Build the score named ``name`` from :data:`SCORES`."""
    try:
        cls = SCORES[name]
    except KeyError:
        raise ValueError(f"score: unknown {name!r}; allowed: {', '.join(sorted(SCORES))}") from None
    return cls(heads=heads, d_k=d_k)


def soft_cap(x: Tensor, cap: float) -> Tensor:
    """c tanh(x / c): x squashed smoothly into (-c, c) (Gemma 2's soft-capping, as transformers
    computes it: divide, tanh, multiply)."""
    return torch.tanh(x / cap) * cap
