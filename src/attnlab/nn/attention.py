"""Scaled dot-product attention with a soft or a hard normalizer.

    Attention(Q, K, V) = a(Q K^T / sqrt(d_k)) V                     (Vaswani et al. §3.2.1, Eq. 1)

where ``a`` is applied row-wise (Li's slides, "Attention in Transformers"):

* ``softmax`` (soft attention): a weighted sum of the values, weights proportional to exp(score).
* ``hardmax`` (hard attention, Hahn §3): one-hot on the argmax of each row, so row n of the output
  is the value v_{i_n} with i_n = argmax_j score_nj. Ties go to the first position (Hahn §3,
  footnote 1).

A boolean mask (True = may attend, :mod:`attnlab.nn.masks`) blocks pairs by setting their score to
-inf (Li's slides, "Masked attention"). A query row with no allowed key yields a zero output and
zero gradients, never NaN; so does attention over no keys at all (T_k = 0), for every normalizer:
the output is zeros (..., T_q, d_v), the weights an empty (..., T_q, 0), an empty weighted sum.

The file reads top-down: :func:`attention`, then the two normalizers of :data:`NORMALIZERS`:

* soft -> :func:`attnlab.nn.attention_backends.softmax_attention`: one of the implementations of
  the same softmax(mask(scale Q K^T + bias)) V (``explicit``, the formula step by step; ``sdpa``,
  PyTorch's fused kernel; ``short`` and ``decode``, attnlab's C++ kernels), picked once per call
  under a setting resolved once (``backend=``: a module's, chosen when it is built; see
  :mod:`attnlab.nn.runtime_config`).
* hard -> blocks of queries x keys with a running first maximum, so the T_q x T_k scores exist
  only block by block (the one-hot weights whole only when asked for).

float16 and bfloat16 inputs are scored and normalised in float32 and the output (and weights)
returned in the input dtype, as fused kernels accumulate: the explicit path upcasts q, k and v
(:func:`_in_float32`), the fused kernels do it themselves, and hard attention takes its argmax over
float32 scores. In float16, q . k passes 65504 for inputs of std 100 over d_k = 16, and a row of
inf scores made NaN outputs and gradients. float32 and float64 inputs take the paths above unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.nn.attention_backends import (
    HALF_DTYPES,
    ScoreFn,
    backend_setting,
    dot_scores,
    softmax_attention,
)
from attnlab.nn.masks import check_mask, combine_masks

__all__ = ["attention", "NORMALIZERS", "ScoreFn", "Normalizer"]

Normalizer = Literal["softmax", "hardmax"]


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None = None,
    *,
    normalizer: Normalizer = "softmax",
    return_weights: bool = False,
    causal: bool = False,
    scale: float | None = None,
    score_fn: ScoreFn | None = None,
    dropout_p: float = 0.0,
    straight_through: bool = False,
    bias: Tensor | None = None,
    backend: str | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention(Q, K, V) = a(mask(Q K^T / sqrt(d_k))) V  (Vaswani Eq. 1; Hahn §3; Li's slides).

    Args:
        q: queries.
        k: keys.
        v: values.
        mask: bool, True = may attend, broadcastable to (..., T_q, T_k). Any other dtype is a
            ``TypeError``.
        normalizer: ``"softmax"`` (soft) or ``"hardmax"`` (hard; ties to the first position).
        return_weights: also return the attention weights.
        causal: also block keys after each query (bottom-right aligned when T_k > T_q, as in
            decoding with a KV cache). Uses SDPA's ``is_causal`` when no mask is materialised.
        scale: multiplies Q K^T; defaults to 1/sqrt(d_k). ``1.0`` gives plain dot-product scores.
        score_fn: replaces the dot product with a custom pairwise score (e.g. additive). Such
            scores are always computed explicitly.
        dropout_p: dropout on the soft attention weights (pass 0 at evaluation).
        straight_through: hard attention only: the forward pass is hard, the backward pass uses the
            gradient of soft attention. Without it, hard attention passes gradients to ``v`` only.
        bias: an additive float bias on the scores, a(mask(scale Q K^T + bias)) V (ALiBi's
            -m_h |i - j|, Shaw et al.'s q_i . a^K_ij: :mod:`attnlab.nn.position_bias`). The fused
            kernel takes it as its float ``attn_mask``, the mask folded in as -inf.
        backend: soft attention's implementation, a name of :data:`BACKEND_SETTINGS`: ``auto``
            (the measured choice among those that apply) or one of :data:`BACKENDS`, taken wherever
            it applies. None: the override ``ATTNLAB_BACKEND`` where set, else ``auto`` (a model's
            attention resolves this once, when it is built, and passes its setting).

    Shape:
        q: (..., T_q, d_k);  k: (..., T_k, d_k);  v: (..., T_k, d_v);  bias: broadcastable to (..., T_q, T_k).
        returns output (..., T_q, d_v), and with ``return_weights`` also weights (..., T_q, T_k).

    Returns:
        The output, or ``(output, weights)`` when ``return_weights`` is True. With no keys
        (T_k = 0) the output is zeros and the weights are empty, for every normalizer and backend:
        the empty sum over keys, as for a query row whose keys are all masked.
    """
    _check_qkv(q, k, v)
    check_mask(mask, q.shape[-2], k.shape[-2])
    _check_mask_batch_dims(mask, q, k, v)
    _check_bias(bias, q, k, v)
    if causal and k.shape[-2] < q.shape[-2]:
        raise ValueError(
            f"attention: causal needs T_k >= T_q (the queries are the last T_q keys), got "
            f"T_q={q.shape[-2]}, T_k={k.shape[-2]}"
        )
    try:
        implementation = NORMALIZERS[normalizer]
    except KeyError:
        raise ValueError(f"normalizer: unknown {normalizer!r}; allowed: {', '.join(sorted(NORMALIZERS))}") from None
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    output, weights = implementation(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        score_fn=score_fn,
        dropout_p=dropout_p,
        need_weights=return_weights,
        straight_through=straight_through,
        bias=bias,
        backend=backend_setting() if backend is None else backend,
    )
    return (output, weights) if return_weights else output


# --------------------------------------------------------------------------------------------
# hardmax: a(x) = onehot(argmax_j x_j), first position on ties
# --------------------------------------------------------------------------------------------


def _hardmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    score_fn: ScoreFn | None,
    dropout_p: float,
    need_weights: bool,
    straight_through: bool,
    bias: Tensor | None = None,
    backend: str = "auto",
) -> tuple[Tensor, Tensor | None]:
    """onehot(argmax_j (scale q_i . k_j + bias_ij)) V over the allowed keys, in blocks (``backend``:
    that of the soft attention whose gradient ``straight_through`` takes)."""
    del dropout_p  # dropping a one-hot weight would just zero the output row
    t_q, t_k = q.shape[-2], k.shape[-2]
    lead = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    if t_k == 0:  # no key to pick: the empty sum, zeros (see attention), gradients flowing as zeros
        weights = v.new_zeros(*lead, t_q, 0)  # (..., T_q, 0)
        return torch.matmul(weights, v.expand(*lead, 0, v.shape[-1])), weights if need_weights else None
    key_block = max(1, min(t_k, _HARD_KEY_BLOCK))
    chunk = max(1, _HARD_CHUNK_ELEMENTS // max(1, math.prod(lead) * key_block))
    scores_of = _hard_scores(
        score_fn, scale, upcast=q.dtype in HALF_DTYPES or k.dtype in HALF_DTYPES, keep_scale=bias is not None
    )
    # Filled chunk by chunk: small tensors kept across the loop would pin the heap between the
    # blocks' score buffers and grow it by a block each time (1.4 GiB peak RSS at T = 32k).
    index = torch.empty(*lead, t_q, dtype=torch.long, device=q.device)  # (..., T_q)
    has_key = None if mask is None and not causal else torch.empty(*lead, t_q, dtype=torch.bool, device=q.device)
    with torch.no_grad():  # argmax has no gradient; keep no graph for the scores
        for start in range(0, t_q, chunk):
            stop = min(start + chunk, t_q)
            chunk_mask = _chunk_mask(mask, causal, start, stop, t_q, t_k, q.device)
            # Causal: no query of this chunk sees a key past its last query's position.
            keys_seen = min(t_k, t_k - t_q + stop) if causal else t_k
            chunk_bias = None if bias is None else (bias if bias.shape[-2] == 1 else bias[..., start:stop, :])
            index[..., start:stop] = _first_argmax(
                q[..., start:stop, :], k, chunk_mask, scores_of, key_block, max(1, keys_seen), chunk_bias
            )
            if has_key is not None and chunk_mask is not None:
                has_key[..., start:stop] = chunk_mask.any(dim=-1)
    # One gather for all chunks: its backward scatters into one (..., T_k, d_v) gradient, where a
    # gather per chunk would allocate and fill that whole tensor once per chunk.
    values = v.expand(*lead, t_k, v.shape[-1])  # (..., T_k, d_v)
    output = torch.gather(values, -2, index.unsqueeze(-1).expand(*lead, t_q, v.shape[-1]))  # (..., T_q, d_v)
    weights = F.one_hot(index, t_k).to(v.dtype) if need_weights else None  # (..., T_q, T_k)
    if has_key is not None:
        keeps_row = has_key.unsqueeze(-1).to(v.dtype)  # (..., T_q, 1): rows with no key give 0
        output = output * keeps_row
        weights = None if weights is None else weights * keeps_row
    if straight_through:
        soft = softmax_attention(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=scale,
            score_fn=score_fn,
            dropout_p=0.0,
            need_weights=False,
            straight_through=False,
            bias=bias,
            backend=backend,
        )[0]
        output = soft + (output - soft).detach()  # forward: hard; backward: soft
    return output, weights


NORMALIZERS: dict[str, Callable[..., tuple[Tensor, Tensor | None]]] = {
    "softmax": softmax_attention,
    "hardmax": _hardmax_attention,
}
"""Registry of normalizers ``a(.)``: name -> implementation with the common keyword signature
``(q, k, v, mask, *, causal, scale, score_fn, dropout_p, need_weights, straight_through, bias=None,
backend="auto")`` returning ``(output, weights or None)``."""


# --------------------------------------------------------------------------------------------
# how the formula runs: blocks of hard scores, masks, checks
# --------------------------------------------------------------------------------------------


# Hard attention scores one block of (query rows x keys) at a time: at most 2**20 scores (4 MiB in
# fp32) over at most 1024 keys, so a block stays in cache between its matmul and its max.
_HARD_CHUNK_ELEMENTS = 2**20
_HARD_KEY_BLOCK = 1024


def _first_argmax(
    q: Tensor,
    k: Tensor,
    mask: Tensor | None,
    scores_of: ScoreFn,
    key_block: int,
    keys_seen: int,
    bias: Tensor | None = None,
) -> Tensor:
    """argmax_j score(q_n, k_j) over keys j < ``keys_seen``, the first position on ties, one block of
    keys at a time: each block's first maximum replaces the running one only if strictly greater,
    so an earlier position keeps a tie. The scores of a block stay in cache between the matmul and
    the reduction, where whole rows of T_k scores would not.

    Shape:
        q: (..., c, d_k);  k: (..., T_k, d_k);  mask, bias: broadcastable to (..., c, T_k);  returns (..., c).
    """

    def block_max(first: int) -> tuple[Tensor, Tensor]:
        last = min(first + key_block, keys_seen)
        scores = scores_of(q, k[..., first:last, :])  # (..., c, block)
        if bias is not None:
            scores = scores + bias[..., first:last].to(scores.dtype)
        if mask is not None:
            scores = scores.masked_fill(~(mask if mask.shape[-1] == 1 else mask[..., first:last]), float("-inf"))
        block_best, block_index = scores.max(dim=-1)  # the first maximum of the block
        return block_best, block_index + first

    best, index = block_max(0)
    for first in range(key_block, keys_seen, key_block):
        block_best, block_index = block_max(first)
        better = block_best > best
        best, index = torch.where(better, block_best, best), torch.where(better, block_index, index)
    return index


def _hard_scores(score_fn: ScoreFn | None, scale: float, *, upcast: bool = False, keep_scale: bool = False) -> ScoreFn:
    """The scores hard attention takes the argmax of. A positive scale cannot move the argmax, so
    dot-product scores skip it (a full pass over every T_q x T_k chunk). With ``upcast``
    (float16/bfloat16 queries or keys) the scores are computed in float32: in float16 they overflow
    to inf past 65504, and the first of several infs is not the largest score."""
    if score_fn is not None:
        scores_of = score_fn
    elif scale > 0 and not keep_scale:  # an additive bias is on the scale of scaled scores
        scores_of = lambda q, k: torch.matmul(q, k.transpose(-2, -1))  # noqa: E731  (..., T_q, T_k)
    else:
        scores_of = lambda q, k: dot_scores(q, k, scale)  # noqa: E731
    if not upcast:
        return scores_of
    return lambda q, k: scores_of(q.float(), k.float())


def _chunk_mask(
    mask: Tensor | None, causal: bool, start: int, stop: int, t_q: int, t_k: int, device: torch.device
) -> Tensor | None:
    """The rows start:stop of the full mask, built without materialising all T_q rows."""
    rows = None if mask is None else (mask if mask.shape[-2] == 1 else mask[..., start:stop, :])
    if not causal:
        return rows
    query_pos = torch.arange(t_k - t_q + start, t_k - t_q + stop, device=device).unsqueeze(-1)  # (c, 1)
    key_pos = torch.arange(t_k, device=device).unsqueeze(0)  # (1, T_k)
    return combine_masks(rows, key_pos <= query_pos)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() < 2 or k.dim() < 2 or v.dim() < 2:
        raise ValueError("attention: q, k and v need at least 2 dims (..., T, d)")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"attention: q has d_k={q.shape[-1]} but k has d_k={k.shape[-1]}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"attention: k has T_k={k.shape[-2]} but v has T_k={v.shape[-2]}")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"attention: the batch dims of q {tuple(q.shape[:-2])}, k {tuple(k.shape[:-2])} and "
            f"v {tuple(v.shape[:-2])} do not broadcast"
        ) from None


def _check_bias(bias: Tensor | None, q: Tensor, k: Tensor, v: Tensor) -> None:
    """An additive bias is a floating tensor that broadcasts to the scores without adding dims."""
    if bias is None:
        return
    if not bias.is_floating_point():
        raise TypeError(f"attention: bias must be a floating tensor (a mask is bool), got {bias.dtype}")
    scores = (*torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2]), q.shape[-2], k.shape[-2])
    try:
        fits = torch.broadcast_shapes(scores, bias.shape) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"bias of shape {tuple(bias.shape)} does not broadcast to the scores' {scores}")


def _check_mask_batch_dims(mask: Tensor | None, q: Tensor, k: Tensor, v: Tensor) -> None:
    """The mask may broadcast over the batch dims of q, k and v, but not add to them (which would
    silently change the output's shape)."""
    if mask is None:
        return
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    try:
        fits = torch.broadcast_shapes(batch, mask.shape[:-2]) == batch
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"mask of shape {tuple(mask.shape)} does not broadcast to the attention's "
            f"(..., T_q, T_k) = {(*batch, q.shape[-2], k.shape[-2])}"
        )
