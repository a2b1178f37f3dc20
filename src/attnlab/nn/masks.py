"""The one mask convention of attnlab.

A mask is a ``torch.bool`` tensor, broadcastable to (B, H, T_q, T_k), where True means
"this query may attend to this key". Every function in :mod:`attnlab.nn` takes masks in this
form; conversion to another convention (PyTorch's ``nn.MultiheadAttention`` uses True = "blocked",
additive masks use 0/-inf) happens only at the boundary to a backend.

Masked attention (Li's slides, "Masked attention"; Agarwal Def. 5.2) sets the score of a blocked
pair to -inf before the softmax. A query row with no allowed key at all yields a zero output.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "lengths_to_padding_mask",
    "check_mask",
    "combine_masks",
]


def causal_mask(t_q: int, t_k: int | None = None, *, device: torch.device | str | None = None) -> Tensor:
    """Causal ("shift-right") mask: query i may attend to keys j <= i (Agarwal Def. 5.2).

    When ``t_k > t_q`` the queries are the *last* ``t_q`` positions of a length-``t_k`` sequence,
    as in incremental decoding with a KV cache: query i sits at absolute position ``t_k - t_q + i``.

    Args:
        t_q: number of queries.
        t_k: number of keys; defaults to ``t_q``.
        device: where to build the mask.

    Shape:
        returns (1, 1, T_q, T_k), bool.
    """
    t_k = t_q if t_k is None else t_k
    if t_q < 0 or t_k < t_q:
        raise ValueError(f"causal_mask: need 0 <= t_q <= t_k, got t_q={t_q}, t_k={t_k}")
    query_pos = torch.arange(t_k - t_q, t_k, device=device).unsqueeze(-1)  # (T_q, 1)
    key_pos = torch.arange(t_k, device=device).unsqueeze(0)  # (1, T_k)
    return (key_pos <= query_pos)[None, None]  # (1, 1, T_q, T_k)


def sliding_window_mask(
    t_q: int, window: int, t_k: int | None = None, *, device: torch.device | str | None = None
) -> Tensor:
    """Causal local attention (Mistral, Gemma 2/3): query i may attend to keys j with
    i - window < j <= i, the ``window`` latest positions including its own (Hugging Face's
    ``sliding_window_overlay`` on a causal mask).

    As in :func:`causal_mask`, with ``t_k > t_q`` the queries are the last ``t_q`` positions.

    Shape:
        returns (1, 1, T_q, T_k), bool.
    """
    if window < 1:
        raise ValueError(f"sliding_window_mask: window must be >= 1, got {window}")
    t_k = t_q if t_k is None else t_k
    query_pos = torch.arange(t_k - t_q, t_k, device=device).unsqueeze(-1)  # (T_q, 1)
    key_pos = torch.arange(t_k, device=device).unsqueeze(0)  # (1, T_k)
    return causal_mask(t_q, t_k, device=device) & (key_pos > query_pos - window)[None, None]


def padding_mask(is_token: Tensor) -> Tensor:
    """Key-padding mask from a (B, T_k) boolean "is a real token" tensor.

    Shape:
        is_token: (B, T_k) bool, True at real tokens, False at padding.
        returns (B, 1, 1, T_k), bool: every query may attend to every real key.
    """
    if is_token.dtype != torch.bool or is_token.dim() != 2:
        raise TypeError(f"padding_mask: expected a (B, T_k) bool tensor, got {tuple(is_token.shape)} {is_token.dtype}")
    return is_token[:, None, None, :]  # (B, 1, 1, T_k)


def lengths_to_padding_mask(lengths: Tensor, t_k: int) -> Tensor:
    """Key-padding mask from sequence lengths.

    Shape:
        lengths: (B,) integer lengths, each <= T_k.
        returns (B, 1, 1, T_k), bool.
    """
    if lengths.dim() != 1 or lengths.dtype.is_floating_point:
        raise TypeError(f"lengths_to_padding_mask: expected (B,) integer lengths, got {lengths.dtype}")
    if bool((lengths > t_k).any()) or bool((lengths < 0).any()):
        raise ValueError(f"lengths_to_padding_mask: lengths must lie in [0, {t_k}]")
    positions = torch.arange(t_k, device=lengths.device)
    return padding_mask(positions[None, :] < lengths[:, None])


def check_mask(mask: Tensor | None, t_q: int, t_k: int, *, name: str = "mask") -> Tensor | None:
    """Validate a mask against the convention; return it unchanged.

    Raises:
        TypeError: the mask is not ``torch.bool`` (0/1 floats and additive masks are rejected so
            that no caller silently mixes conventions).
        ValueError: the mask does not broadcast to (..., T_q, T_k).
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        dtype = getattr(mask, "dtype", type(mask).__name__)
        raise TypeError(
            f"{name} must be a torch.bool tensor (True = may attend), got {dtype}; "
            "convert with `mask.bool()` or build it with attnlab.nn.masks helpers"
        )
    if mask.dim() < 2:
        raise ValueError(f"{name} must have at least 2 dims (..., T_q, T_k), got shape {tuple(mask.shape)}")
    if mask.shape[-2] not in (1, t_q) or mask.shape[-1] not in (1, t_k):
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to (..., {t_q}, {t_k})")
    return mask


def combine_masks(*masks: Tensor | None) -> Tensor | None:
    """Logical AND of the given masks, ignoring ``None``; ``None`` if all are ``None``."""
    present = [m for m in masks if m is not None]
    if not present:
        return None
    combined = present[0]
    for mask in present[1:]:
        combined = combined & mask
    return combined
