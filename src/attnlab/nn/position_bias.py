"""Relative positions inside attention: ALiBi's linear biases and Shaw et al.'s learned relative
representations, one module each, chosen once by :class:`attnlab.nn.multi_head.MultiHeadAttention`.

Both act on the scores of self-attention through the distance j - i between key position j and
query position i (positions as given, so left padding, KV-cache offsets and randomized positions
(Ruoss et al. 2023) all work through the same (B|1, T_q, T_k) distance tensor):

* ``alibi`` (Press, Smith & Lewis 2022, "Train Short, Test Long", §3): no position vectors; head h
  adds a fixed linear penalty to its scores,

      e_ij = q_i . k_j / sqrt(d_k) - m_h |i - j|

  (for a causal model j <= i, so -m_h |i - j| = m_h (j - i), the paper's form). The slopes m_h are
  the geometric sequence that starts at 2^(-8/H) and has that ratio: 2^(-8/H), 2^(-16/H), ...,
  2^(-8) for H a power of two; otherwise the slopes of the largest power of two 2^a < H, followed
  by every other slope of 2^(a+1) heads (the paper's reference code, ``get_slopes``).

* ``relative`` (Shaw, Uszkoreit & Vaswani 2018, Eqs. 3-5): learned vectors for clipped distances,

      a^K_ij = w^K_{clip(j - i, k)},   a^V_ij = w^V_{clip(j - i, k)},   clip(x, k) = max(-k, min(k, x))
      e_ij = x_i W^Q (x_j W^K + a^K_ij)^T / sqrt(d_z)
      z_i  = sum_j alpha_ij (x_j W^V + a^V_ij)

  with w^K, w^V of 2k + 1 rows each, shared by the heads of a layer (Shaw §3.2). The key term is a
  query-dependent additive bias, q_i . a^K_ij / sqrt(d_z), so the scores still run on the fused
  kernel; the value term sum_j alpha_ij a^V_ij needs the weights alpha, which are then computed
  explicitly.

Each module returns the additive float bias (B|1, H, T_q, T_k) that :func:`attnlab.nn.attention.attention`
adds to the scores (``bias=``), and may add a term to the heads' outputs (:meth:`PositionBias.add_values`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

__all__ = [
    "PositionBias",
    "ALiBi",
    "ShawRelative",
    "POSITION_BIASES",
    "alibi_slopes",
    "distances",
    "make_position_bias",
]


def alibi_slopes(heads: int) -> list[float]:
    """The head-specific slopes m_1..m_H of ALiBi (Press et al. 2022, §3 and their ``get_slopes``).

    For H = 2^a: m_h = 2^(-8h/H), h = 1..H. Otherwise the 2^a slopes of the largest power of two
    below H, then every other slope of 2^(a+1) heads (the odd-numbered ones), the first H - 2^a.
    """
    if heads <= 0:
        return []
    if heads & (heads - 1) == 0:
        return [2.0 ** (-8.0 * h / heads) for h in range(1, heads + 1)]
    lower = 2 ** math.floor(math.log2(heads))
    return alibi_slopes(lower) + alibi_slopes(2 * lower)[0::2][: heads - lower]


def distances(query_positions: Tensor, key_positions: Tensor) -> Tensor:
    """j - i for every query position i and key position j.

    Shape:
        query_positions: (B|1, T_q);  key_positions: (B|1, T_k);  returns (B|1, T_q, T_k) int64.
    """
    return key_positions.unsqueeze(-2) - query_positions.unsqueeze(-1)


class PositionBias(nn.Module):
    """Interface: :meth:`forward` gives the additive score bias; :meth:`add_values` a term for the
    heads' outputs (identity unless ``needs_weights``).

    Shape:
        q: (B, H, T_q, d_k) (after the score's ``prepare``);  distance: (B|1, T_q, T_k);
        returns bias (B|1, H, T_q, T_k) in q's dtype.
    """

    needs_weights: bool = False

    def forward(self, q: Tensor, distance: Tensor, scale: float) -> Tensor:
        raise NotImplementedError

    def add_values(self, head_outputs: Tensor, weights: Tensor | None, distance: Tensor) -> Tensor:
        return head_outputs

    def head_subset_state(self, index: Tensor) -> dict[str, Tensor]:
        """This module's state restricted to the heads ``index`` (keys relative to the module)."""
        return {}


class ALiBi(PositionBias):
    """bias_hij = -m_h |j - i|  (Press et al. 2022, §3).

    The slopes are a persistent buffer: physical head pruning keeps each remaining head's own slope
    (:meth:`head_subset_state`), which the formula for the smaller H would not give.

    Attributes:
        slopes: (H,) m_h.
    """

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.register_buffer("slopes", torch.tensor(alibi_slopes(heads), dtype=torch.float32))  # (H,)

    def forward(self, q: Tensor, distance: Tensor, scale: float) -> Tensor:
        slopes = self.slopes.to(q.dtype)[:, None, None]  # (H, 1, 1)
        return -slopes * distance.abs().to(q.dtype).unsqueeze(-3)  # (B|1, H, T_q, T_k)

    def head_subset_state(self, index: Tensor) -> dict[str, Tensor]:
        return {"slopes": self.slopes.detach()[index]}

    def extra_repr(self) -> str:
        return f"heads={self.slopes.numel()}"


class ShawRelative(PositionBias):
    """Learned relative position representations with clipping distance k (Shaw et al. 2018, §3).

    Args:
        d_k, d_v: the head sizes of keys and values.
        clip: the clipping distance k; distances beyond +-k share the representation of +-k.

    Attributes:
        key_table: (2k + 1, d_k), row k + r = w^K_r.
        value_table: (2k + 1, d_v), row k + r = w^V_r.
    """

    needs_weights = True

    def __init__(self, d_k: int, d_v: int, clip: int) -> None:
        super().__init__()
        if clip < 1:
            raise ValueError(f"relative_clip: must be a positive integer, got {clip}")
        self.clip = clip
        self.key_table = nn.Parameter(torch.randn(2 * clip + 1, d_k) * d_k**-0.5)
        self.value_table = nn.Parameter(torch.randn(2 * clip + 1, d_v) * d_v**-0.5)

    def _rows(self, distance: Tensor) -> Tensor:
        """clip(j - i, k) + k: the row of w^K and w^V, (B|1, T_q, T_k)."""
        return distance.clamp(-self.clip, self.clip) + self.clip

    def forward(self, q: Tensor, distance: Tensor, scale: float) -> Tensor:
        per_row = torch.matmul(q, self.key_table.to(q.dtype).t())  # (B, H, T_q, 2k+1): q_i . w^K_r
        rows = self._rows(distance).unsqueeze(-3)  # (B|1, 1, T_q, T_k)
        batch, heads = per_row.shape[:2]
        rows = rows.expand(batch, heads, *rows.shape[-2:])
        return per_row.gather(-1, rows) * scale  # (B, H, T_q, T_k): q_i . a^K_ij / sqrt(d_z)

    def add_values(self, head_outputs: Tensor, weights: Tensor | None, distance: Tensor) -> Tensor:
        """z_i += sum_j alpha_ij a^V_ij = sum_r (sum_{j: row_ij = r} alpha_ij) w^V_r."""
        assert weights is not None  # needs_weights: the caller computes them
        rows = self._rows(distance).unsqueeze(-3).expand_as(weights)  # (B, H, T_q, T_k)
        mass = weights.new_zeros(*weights.shape[:-1], 2 * self.clip + 1)  # (B, H, T_q, 2k+1)
        mass = mass.scatter_add(-1, rows, weights)
        return head_outputs + torch.matmul(mass, self.value_table.to(weights.dtype))

    def head_subset_state(self, index: Tensor) -> dict[str, Tensor]:
        return {"key_table": self.key_table.detach(), "value_table": self.value_table.detach()}

    def extra_repr(self) -> str:
        return f"clip={self.clip}"


POSITION_BIASES: dict[str, Callable[..., PositionBias]] = {
    "alibi": lambda *, heads, d_k, d_v, clip: ALiBi(heads),
    "relative": lambda *, heads, d_k, d_v, clip: ShawRelative(d_k, d_v, clip),
}
"""Registry: a ``positional`` name that acts inside attention -> builder of its bias module."""


def make_position_bias(name: str, *, heads: int, d_k: int, d_v: int, clip: int = 16) -> PositionBias:
    """Build the bias module of ``name`` in :data:`POSITION_BIASES`."""
    try:
        build = POSITION_BIASES[name]
    except KeyError:
        raise ValueError(f"position_bias: unknown {name!r}; allowed: {', '.join(sorted(POSITION_BIASES))}") from None
    return build(heads=heads, d_k=d_k, d_v=d_v, clip=clip)
