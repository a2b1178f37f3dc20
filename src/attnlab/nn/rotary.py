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

Partial rotary (GPT-NeoX/Pythia's ``rotary_pct``, Phi-3's ``partial_rotary_factor``): only the
first d_rot = int(d * fraction) dims of each head are rotated, as above with d_rot in place of d;
the other d - d_rot pass unchanged.

Scaled frequencies for long contexts (Hugging Face's ``rope_scaling``): :data:`ROPE_SCALINGS`
maps a scaling type to a function (base, d_rot, params) -> (theta, attention factor); the cosines
and sines are multiplied by the attention factor (YaRN's mscale; 1 for the others):

* ``linear`` (position interpolation, Chen et al. 2023): theta_i / factor;
* ``llama3`` (Llama 3.1): theta_i / factor for wavelengths 2 pi / theta_i above L / low_freq_factor,
  theta_i below L / high_freq_factor, a linear blend between (L the original context length);
* ``yarn`` (Peng et al. 2023, "YaRN"): a ramp between theta_i / factor and theta_i over the dims
  whose rotations in L positions lie between beta_slow and beta_fast, attention factor
  0.1 ln(factor) + 1 (or mscale / mscale_all_dim, or ``attention_factor`` as given).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.kernels import calibration, fused_rotary_applies
from attnlab.kernels import rotary as fused_rotary

__all__ = [
    "RotaryEmbedding",
    "rotate_half",
    "positions_of_tokens",
    "ROPE_SCALINGS",
    "RopeScaling",
    "rope_frequencies",
    "rope_scaling_type",
]

RopeScaling = Callable[[float, int, Mapping[str, Any]], tuple[Tensor, float]]
"""(base, d_rot, params) -> (theta: (d_rot / 2,) float32, attention factor)."""


def _default_frequencies(base: float, d_rot: int) -> Tensor:
    """theta_i = base^(-2i / d_rot), i < d_rot / 2, in float32 (as Hugging Face computes them)."""
    exponents = torch.arange(0, d_rot, 2, dtype=torch.int64).float() / d_rot
    return 1.0 / (base**exponents)


def _param(params: Mapping[str, Any], name: str, default: Any = None) -> Any:
    value = params.get(name, default)
    if value is None:
        raise ValueError(f"rope_scaling: type {rope_scaling_type(params)!r} needs the key {name!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"rope_scaling: {name!r} must be a number, got {value!r}")
    return value


def _unscaled(base: float, d_rot: int, params: Mapping[str, Any]) -> tuple[Tensor, float]:
    """Hugging Face's ``default``: theta_i as they are."""
    return _default_frequencies(base, d_rot), 1.0


def _linear(base: float, d_rot: int, params: Mapping[str, Any]) -> tuple[Tensor, float]:
    """Position interpolation: theta_i / factor (Chen et al. 2023)."""
    return _default_frequencies(base, d_rot) / _param(params, "factor"), 1.0


def _llama3(base: float, d_rot: int, params: Mapping[str, Any]) -> tuple[Tensor, float]:
    """Llama 3.1's: long wavelengths divided by factor, short ones kept, a blend between."""
    factor, low, high = (_param(params, k) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    context = _param(params, "original_max_position_embeddings")
    theta = _default_frequencies(base, d_rot)
    wavelength = 2 * math.pi / theta
    scaled = torch.where(wavelength > context / low, theta / factor, theta)
    smooth = (context / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelength < context / high) * ~(wavelength > context / low)
    return torch.where(medium, blended, scaled), 1.0


def _yarn(base: float, d_rot: int, params: Mapping[str, Any]) -> tuple[Tensor, float]:
    """YaRN (Peng et al. 2023): interpolate the slow dims, keep the fast ones, ramp between."""
    factor = _param(params, "factor")
    context = _param(params, "original_max_position_embeddings")
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:  # the dim that turns ``rotations`` times in L positions
        return (d_rot * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d_rot - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(d_rot // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    powers = base ** (torch.arange(0, d_rot, 2).to(dtype=torch.float) / d_rot)
    kept = 1 - ramp  # 1: extrapolate (theta_i as is), 0: interpolate (theta_i / factor)
    return (1.0 / (factor * powers)) * (1 - kept) + (1.0 / powers) * kept, float(attention_factor)


ROPE_SCALINGS: dict[str, RopeScaling] = {
    "default": _unscaled,
    "linear": _linear,
    "llama3": _llama3,
    "yarn": _yarn,
}
"""Registry of rotary frequency scalings (Hugging Face's ``rope_scaling`` types): type -> function
(base, d_rot, params) -> (theta, attention factor); ``default`` leaves theta as it is."""


def rope_scaling_type(params: Mapping[str, Any]) -> str:
    """The type a ``rope_scaling`` dict names: its ``rope_type`` key, or ``type`` in older files."""
    kind = params.get("rope_type", params.get("type"))
    if kind is None:
        raise ValueError(f"rope_scaling: needs a 'rope_type' (or 'type') key; supported: {', '.join(ROPE_SCALINGS)}")
    return kind


def rope_frequencies(base: float, d_rot: int, scaling: Mapping[str, Any] | None) -> tuple[Tensor, float]:
    """theta (d_rot / 2,) and the attention factor for ``base`` and an optional ``rope_scaling`` dict.

    Raises:
        ValueError: an unknown scaling type (listing the supported ones) or a missing parameter.
    """
    if scaling is None:
        return _default_frequencies(base, d_rot), 1.0
    kind = rope_scaling_type(scaling)
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling: unknown type {kind!r}; supported: {', '.join(ROPE_SCALINGS)}")
    return ROPE_SCALINGS[kind](base, d_rot, scaling)


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
    Llama computes them, and the cosines and sines multiplied by the scaling's attention factor
    where it is not 1.

    Args:
        head_dim: d, the width of one query/key head.
        base: the base of the angles (Llama 2: 10,000; SmolLM2: 100,000).
        fraction: rotate the first d_rot = int(d * fraction) dims of each head only (even, > 0).
        scaling: a ``rope_scaling`` dict (:data:`ROPE_SCALINGS`), or None.

    Shape:
        q: (B, H, T, d);  k: (B, H_kv, T, d);  positions: (B, T) or (T,) int64;
        returns (q, k) rotated, each in its input's dtype.
    """

    def __init__(
        self, head_dim: int, base: float = 10000.0, *, fraction: float = 1.0, scaling: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__()
        rotated = int(head_dim * fraction)
        if rotated % 2 or rotated <= 0 or rotated > head_dim:
            raise ValueError(f"rope: the rotated width int(d_k * fraction) must be even and in (0, d_k], got {rotated}")
        if not base > 0:
            raise ValueError(f"rope_base must be positive, got {base}")
        self.head_dim, self.rotary_dim, self.base = head_dim, rotated, float(base)
        inv_freq, self.attention_factor = rope_frequencies(self.base, rotated, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # (d_rot/2,)
        self.register_buffer("_cos", torch.empty(0, rotated), persistent=False)  # (T_max, d_rot)
        self.register_buffer("_sin", torch.empty(0, rotated), persistent=False)
        # Chosen once: rotate whole heads, or their first d_rot dims only.
        self._rotate_head = _rotate if rotated == head_dim else self._rotate_part

    def forward(self, q: Tensor, k: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        cos, sin = self._angles(positions)  # (B|1, 1, T, d_rot)
        return self._rotate_head(q, cos, sin), self._rotate_head(k, cos, sin)

    def _rotate_part(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """[RoPE(x[:d_rot]), x[d_rot:]]: partial rotary, as GPT-NeoX applies it."""
        rotated = self.rotary_dim
        return torch.cat((_rotate(x[..., :rotated], cos, sin), x[..., rotated:]), dim=-1)

    def _angles(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        needed = int(positions.max()) + 1 if positions.numel() else 1
        if needed > self._cos.shape[0] or self._cos.device != positions.device:
            self._grow(max(needed, 2 * self._cos.shape[0], 64), positions.device)
        rows = positions if positions.dim() == 2 else positions.unsqueeze(0)  # (B|1, T)
        return self._cos[rows].unsqueeze(1), self._sin[rows].unsqueeze(1)  # (B|1, 1, T, d)

    def _grow(self, length: int, device: torch.device) -> None:
        inv_freq = self.inv_freq.to(device)
        angles = torch.arange(length, device=device, dtype=torch.float32).unsqueeze(-1) * inv_freq  # (T, d/2)
        both = torch.cat((angles, angles), dim=-1)  # (T, d_rot): theta_i for x'_i and x''_i
        self._cos, self._sin = both.cos(), both.sin()
        if self.attention_factor != 1.0:  # YaRN's mscale, on the cosines and sines as HF applies it
            self._cos, self._sin = self._cos * self.attention_factor, self._sin * self.attention_factor

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, base={self.base:g}"


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
