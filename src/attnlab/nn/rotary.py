"""Rotary position embeddings (RoPE; Su et al. 2021, "RoFormer", Eq. 34), as Llama applies them.

Positions enter attention through the queries and keys, not the input: a query or key x at
position m (one head, width d, split into halves x = [x', x''] of d/2 each) becomes

    RoPE(x, m) = x * cos(m theta) + rotate_half(x) * sin(m theta),   rotate_half([x', x'']) = [-x'', x']

with theta_i = base^(-2i/d) for i < d/2, the same angle for x'_i and x''_i. This rotates each
pair (x'_i, x''_i) by the angle m theta_i, so

    RoPE(q, m) . RoPE(k, n) = q . R((n - m) theta) k

depends on the positions only through m - n: attention scores see relative positions, and a KV
cache may keep its keys rotated once, at the position where they were computed.

The pairing (x_i, x_{i + d/2}) is Hugging Face's ``rotate_half`` layout; llama.cpp pairs
neighbours (x_{2i}, x_{2i+1}) instead, which is why :mod:`attnlab.pretrained.gguf` permutes the
rows of W_Q and W_K on import.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.kernels import calibration, fused_rotary_applies
from attnlab.kernels import rotary as fused_rotary

__all__ = ["RotaryEmbedding", "rotate_half", "positions_of_tokens"]


def rotate_half(x: Tensor) -> Tensor:
    """[x', x''] -> [-x'', x'] over the last dim (the 90-degree rotation of each pair)."""
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def positions_of_tokens(is_token: Tensor, new: int) -> Tensor:
    """The positions of the last ``new`` columns, counting real tokens only.

    A left-padded row's first real token is at position 0, as if it had no padding; a padding
    column takes the position of the token before it (its key is masked anyway).

    Shape:
        is_token: (B, T_k) bool over every key so far;  returns (B, new) int64.
    """
    counted = is_token.long().cumsum(dim=-1) - 1  # (B, T_k)
    return counted[:, -new:].clamp(min=0)


class RotaryEmbedding(nn.Module):
    """Rotates queries and keys by their positions (see the module docstring).

    The cosines and sines are kept in a table that grows (doubling) to the largest position
    seen; it is a non-persistent buffer, so it follows the module across devices and is never
    saved. The angles are computed in float32 as m * theta_i, one product each, as Hugging Face's
    Llama computes them.

    Args:
        head_dim: d, the width of one query/key head (even).
        base: the base of the angles (Llama 2: 10,000; SmolLM2: 100,000).

    Shape:
        q: (B, H, T, d);  k: (B, H_kv, T, d);  positions: (B, T) or (T,) int64;
        returns (q, k) rotated, each in its input's dtype.
    """

    def __init__(self, head_dim: int, base: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rope: the head size must be even, got {head_dim}")
        if not base > 0:
            raise ValueError(f"rope_base must be positive, got {base}")
        self.head_dim, self.base = head_dim, float(base)
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.register_buffer("inv_freq", 1.0 / (self.base**exponents), persistent=False)  # (d/2,)
        self.register_buffer("_cos", torch.empty(0, head_dim), persistent=False)  # (T_max, d)
        self.register_buffer("_sin", torch.empty(0, head_dim), persistent=False)

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._angles(positions)  # (B|1, 1, T, d)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if needed > self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(max(needed, 2 * self._cos.shape[0], 64), positions.device)
        rows = positions if positions.dim() == 2 else positions.unsqueeze(0)  # (B|1, T)
        return self._cos[rows].unsqueeze(1), self._sin[rows].unsqueeze(1)  # (B|1, 1, T, d)

    def _grow(self, length: int, device: torch.device) -> None:
        inv_freq = self.inv_freq.to(device)
        angles = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(-1) * inv_freq  # (T, d/2)
        both = torch.cat((angles, angles), dim=-1)  # (T, d): theta_i for x'_i and x''_i
        self._cos, self._sin = both.cos(), both.sin()

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE(x, m) = x cos(m theta) + rotate_half(x) sin(m theta), in x's dtype; in one pass by
    attnlab's kernel where it applies (no gradient wanted: :mod:`attnlab.kernels.gated`) and was
    measured faster than PyTorch's ops for this shape class (:mod:`attnlab.kernels.calibration`)."""
    if fused_rotary_applies(x, cos):
        key = ("rotary", calibration.bucket(x.shape[0] * x.shape[1]), calibration.bucket(x.shape[2]), x.shape[3])
        choice = calibration.chosen(key) or calibration.choose(
            key, {"native": lambda: fused_rotary(x, cos, sin), "torch": lambda: _rotate_by_ops(x, cos, sin)}
        )
        if choice == "native":
            return fused_rotary(x, cos, sin)
    return _rotate_by_ops(x, cos, sin)


def _rotate_by_ops(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)
