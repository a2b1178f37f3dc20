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

The file reads top-down: :func:`attention`, then the two normalizers of :data:`NORMALIZERS`, each
the formula first, then how it is run:

* soft -> one of the :data:`BACKENDS`, implementations of the same softmax(mask(scale Q K^T + bias)) V,
  picked by :func:`select_backend` among those whose ``applies`` predicate takes the call:
  ``explicit``, the formula step by step (the only one that returns the weights or takes a custom
  score function); ``sdpa``, ``torch.nn.functional.scaled_dot_product_attention`` (O(T) memory);
  ``short`` and ``decode``, attnlab's C++ CPU kernels for short heads and for a decoding step's
  few queries (:mod:`attnlab.kernels`). Where several apply on a CPU, the fastest is measured on
  this machine at the first call of a shape class (:mod:`attnlab.kernels.calibration`); off the
  CPU ``sdpa`` is taken. ``backend=name`` forces one wherever it applies: a module's setting,
  resolved once when it is built (:class:`attnlab.nn.multi_head.MultiHeadAttention`, whose default
  is the documented override ``ATTNLAB_BACKEND``, read then), or an argument of :func:`attention`.
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
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import kernels
from attnlab.errors import ConfigError
from attnlab.kernels import calibration
from attnlab.nn.masks import causal_mask, check_mask, combine_masks

__all__ = [
    "attention",
    "NORMALIZERS",
    "BACKENDS",
    "BACKEND_SETTINGS",
    "Backend",
    "backend_setting",
    "select_backend",
    "ScoreFn",
    "Normalizer",
]

Normalizer = Literal["softmax", "hardmax"]
ScoreFn = Callable[[Tensor, Tensor], Tensor]
"""Maps queries (..., T_q, d_k) and keys (..., T_k, d_k) to scores (..., T_q, T_k)."""


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
# softmax: a(x) = softmax(x), by the backend select_backend picks
# --------------------------------------------------------------------------------------------


def _softmax_attention(
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
    """softmax(mask(scale Q K^T + bias)) V by the one of :data:`BACKENDS` that
    :func:`select_backend` picks for the call (``backend``: a setting of :data:`BACKEND_SETTINGS`)."""
    del straight_through  # a soft forward pass already has the soft gradient
    chosen = select_backend(
        q, k, v, mask, bias, dropout_p, need_weights, score_fn, causal=causal, scale=scale, backend=backend
    )
    return chosen.run(
        q,
        k,
        v,
        mask,
        causal=causal,
        scale=scale,
        score_fn=score_fn,
        dropout_p=dropout_p,
        bias=bias,
        need_weights=need_weights,
    )


@dataclass(frozen=True)
class Backend:
    """One implementation of softmax(mask(scale Q K^T + bias)) V.

    Attributes:
        name: its name in :data:`BACKENDS` (and for ``ATTNLAB_BACKEND``).
        applies: ``(q, k, v, mask, bias, dropout_p, need_weights, score_fn) -> bool``, whether it
            takes the call.
        run: ``(q, k, v, mask, *, causal, scale, score_fn, dropout_p, bias, need_weights)`` ->
            ``(output, weights or None)``; the weights only from a backend that applies with
            ``need_weights``.
    """

    name: str
    applies: Callable[..., bool]
    run: Callable[..., tuple[Tensor, Tensor | None]]


def select_backend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    dropout_p: float,
    need_weights: bool,
    score_fn: ScoreFn | None,
    *,
    causal: bool = False,
    scale: float = 1.0,
    backend: str | None = None,
) -> Backend:
    """The backend of :data:`BACKENDS` that runs this soft-attention call.

    ``backend`` (a setting of :data:`BACKEND_SETTINGS`; None: :func:`backend_setting`, the
    override ``ATTNLAB_BACKEND`` or ``auto``) where it names a backend that applies; else the only one
    that applies; else, on a CPU, the one measured fastest for the call's shape class (device,
    dtype, whether a gradient is wanted, mask, bias, causal, and T_q, T_k, d_k, d_v and the rows
    of (batch x head) rounded up to powers of two), timed once per machine by
    :mod:`attnlab.kernels.calibration` on the call's own tensors; else (off the CPU, with dropout,
    whose random draws the timing must not consume, or scores too large to time cheaply) the
    first that applies of ``decode``, ``short``, ``sdpa``, ``explicit``.
    """
    if backend is None:
        backend = backend_setting()
    if backend != "auto":
        forced = _forced_backend(backend)
        if forced.applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn):
            return forced
    if need_weights or score_fn is not None:
        return _EXPLICIT  # the only one that returns the weights or takes a custom score
    key = _shape_class(q, k, v, mask, bias, dropout_p, causal)
    if key is not None:  # the hot path: this class was measured
        name = calibration.chosen(key)
        if name is not None:
            measured = BACKENDS[name]
            if measured.applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn):
                return measured
    applicable = [each for each in BACKENDS.values() if each.applies(q, k, v, mask, bias, dropout_p, False, None)]
    if key is None or len(applicable) == 1 or not calibration.can_measure():
        return applicable[0]
    timed = {each.name: _timed(each, q, k, v, mask, bias, causal, scale) for each in applicable}
    return BACKENDS[calibration.choose(key, timed)]


# The backends, in the order taken where nothing is measured. --------------------------------


def _decode_applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn) -> bool:  # noqa: ANN001
    return (
        bias is None
        and not need_weights
        and score_fn is None
        and kernels.decode_attention_applies(q, k, v, mask, dropout_p)
    )


def _decode(q, k, v, mask, *, causal, scale, score_fn, dropout_p, bias, need_weights):  # noqa: ANN001, ANN202
    """attnlab's kernel for a decoding step's few queries (:func:`attnlab.kernels.decode_attention`)."""
    return kernels.decode_attention(q, k, v, mask, causal=causal, scale=scale), None


def _short_applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn) -> bool:  # noqa: ANN001
    return (
        bias is None
        and not need_weights
        and score_fn is None
        and kernels.short_attention_applies(q, k, v, mask, dropout_p)
    )


def _short(q, k, v, mask, *, causal, scale, score_fn, dropout_p, bias, need_weights):  # noqa: ANN001, ANN202
    """attnlab's kernel for short heads, forward and backward (:func:`attnlab.kernels.short_attention`)."""
    return kernels.short_attention(q, k, v, causal=causal, scale=scale), None


def _sdpa_applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn) -> bool:  # noqa: ANN001
    return not need_weights and score_fn is None


def _sdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    score_fn: ScoreFn | None,
    dropout_p: float,
    bias: Tensor | None,
    need_weights: bool,
) -> tuple[Tensor, None]:
    """softmax(mask(scale Q K^T + bias)) V by PyTorch's fused kernel, without keeping the weights.

    The bool mask (True = may attend there too) goes in as is; with a bias, it becomes -inf in the
    float ``attn_mask`` here, at the backend boundary, and nowhere else. A row with no allowed key
    would be NaN inside the kernel: it is opened, and its output zeroed.
    """
    t_q, t_k = q.shape[-2], k.shape[-2]
    if bias is None and mask is None and (not causal or t_q == t_k):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal, scale=scale), None
    if bias is None and mask is None and t_q == 1:  # one new query against a cache: it may see every key
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, scale=scale), None
    mask = _full_mask(mask, causal, t_q, t_k, q.device)
    if mask is None:  # a bias alone
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias.to(q.dtype), dropout_p=dropout_p, scale=scale
        ), None
    has_key = mask.any(dim=-1, keepdim=True)  # (..., T_q, 1)
    if bias is None:
        attn_mask = mask | ~has_key
    else:
        minus_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)
        attn_mask = torch.where(mask | ~has_key, bias.to(q.dtype), minus_inf)
    output = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale)
    return output * has_key, None


def _explicit_applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn) -> bool:  # noqa: ANN001
    return True


def _explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    score_fn: ScoreFn | None,
    dropout_p: float,
    bias: Tensor | None,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    """The formula step by step: scores, mask, softmax, weighted sum (:func:`_softmax_explicit`)."""
    output, weights = _softmax_explicit(
        q, k, v, mask, causal=causal, scale=scale, score_fn=score_fn, dropout_p=dropout_p, bias=bias
    )
    return output, weights if need_weights else None


def _softmax_explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    score_fn: ScoreFn | None,
    dropout_p: float,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Explicit scores, softmax and weighted sum; float16/bfloat16 inputs are computed in float32
    and the output and weights returned in the values' dtype (see :func:`_in_float32`)."""
    if q.dtype in _HALF_DTYPES or k.dtype in _HALF_DTYPES or v.dtype in _HALF_DTYPES:
        return _in_float32(q, k, v, mask, causal=causal, scale=scale, score_fn=score_fn, dropout_p=dropout_p, bias=bias)
    scores = score_fn(q, k) if score_fn is not None else _dot_scores(q, k, scale)  # (..., T_q, T_k)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    mask = _full_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        # finfo.min, not -inf: a fully masked row then stays finite, and `* mask` zeroes it.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    if mask is not None:
        weights = weights * mask
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v), weights


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def _in_float32(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    *,
    causal: bool,
    scale: float,
    score_fn: ScoreFn | None,
    dropout_p: float,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Soft attention of float16/bfloat16 inputs with the scores, softmax and weighted sum in float32
    (as fused kernels accumulate), the output and weights cast back to the values' dtype.

    In float16, q . k overflows past 65504 (inputs of std 100 over d_k = 16 reach it) and the
    softmax of an inf row is NaN, in the output and every gradient. The casts are differentiable,
    so the gradients come back in the inputs' dtypes, also computed in float32.
    """
    output, weights = _softmax_explicit(
        q.float(),
        k.float(),
        v.float(),
        mask,
        causal=causal,
        scale=scale,
        score_fn=score_fn,
        dropout_p=dropout_p,
        bias=None if bias is None else bias.float(),
    )
    return output.to(v.dtype), weights.to(v.dtype)


BACKENDS: dict[str, Backend] = {
    "decode": Backend("decode", _decode_applies, _decode),
    "short": Backend("short", _short_applies, _short),
    "sdpa": Backend("sdpa", _sdpa_applies, _sdpa),
    "explicit": Backend("explicit", _explicit_applies, _explicit),
}
"""Registry of soft-attention implementations: name -> :class:`Backend`, all computing
softmax(mask(scale Q K^T + bias)) V (Vaswani Eq. 1), in the order taken where nothing is measured:

* ``decode``: attnlab's C++ kernel for 1 to 4 queries per (batch, head) against a KV cache,
  float32 on a CPU, no gradient, no bias (:func:`attnlab.kernels.decode_attention_applies`);
* ``short``: attnlab's C++ kernel for short heads (up to 256 queries and keys), float32 on a CPU,
  no mask, with its backward (:func:`attnlab.kernels.short_attention_applies`);
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` for any call without weights or
  a custom score;
* ``explicit``: the formula step by step, for any call (the only one with the weights, a custom
  score function, or a second derivative).
"""

_EXPLICIT = BACKENDS["explicit"]

_MAX_TIMED_SCORES = 2**22
"""Calls with more scores than this (B x H x T_q x T_k; 16 MiB in float32) are not timed: the
explicit formula would hold them all, and the timing would take more than milliseconds."""


BACKEND_SETTINGS = ("auto", *BACKENDS)
"""The values of a backend setting (``MultiHeadAttention(backend=...)``, :func:`attention`'s
``backend``, the override ``ATTNLAB_BACKEND``): ``auto``, the measured choice, or a backend's name."""


def backend_setting(name: str | None = None) -> str:
    """``name`` checked against :data:`BACKEND_SETTINGS`; None: the documented override
    ``ATTNLAB_BACKEND`` from the environment where it is set, else ``auto``. A model's attention
    calls this once, when it is built; a ConfigError names the variable or the setting."""
    source = "attention backend"
    if name is None:
        name, source = os.environ.get("ATTNLAB_BACKEND") or "auto", "ATTNLAB_BACKEND"
    if name not in BACKEND_SETTINGS:
        raise ConfigError(f"{source}: unknown {name!r}; allowed: {', '.join(sorted(BACKEND_SETTINGS))}")
    return name


def _forced_backend(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"attention backend: unknown {name!r}; allowed: {', '.join(sorted(BACKENDS))}") from None


def _shape_class(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, dropout_p: float, causal: bool
) -> tuple | None:
    """The key under which a CPU call's measured backend is remembered, or None where none is
    measured (another device, dropout, or too many scores to time cheaply)."""
    if q.device.type != "cpu" or dropout_p > 0.0:
        return None
    # Inline arithmetic, no helper calls: this runs at every call (~30 per decoded token).
    shape, t_k = q.shape, k.shape[-2]
    t_q, d_k, d_v = shape[-2], shape[-1], v.shape[-1]
    rows = math.prod(shape[:-2])  # (batch x head) of the queries
    if rows * t_q * t_k > _MAX_TIMED_SCORES:
        return None
    return (
        "attention",
        q.dtype,
        kernels.native.gradient_wanted(q, k, v, bias),
        mask is not None,
        bias is not None,
        causal,
        len(shape),
        1 << (t_q - 1).bit_length() if t_q else 0,  # each size rounded up to a power of two (calibration.bucket)
        1 << (t_k - 1).bit_length() if t_k else 0,
        1 << (d_k - 1).bit_length() if d_k else 0,
        1 << (d_v - 1).bit_length() if d_v else 0,
        1 << (rows - 1).bit_length() if rows else 0,
    )


def _timed(
    backend: Backend,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor | None,
    bias: Tensor | None,
    causal: bool,
    scale: float,
) -> Callable[[], object]:
    """One call of ``backend`` on detached views of the call's tensors, to time: forward under
    ``no_grad``, or forward and backward on fresh leaves where a gradient is wanted (nothing is
    recorded in the caller's graph, no random number is drawn)."""
    leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, bias)]
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    q, k, v, bias = leaves

    def forward() -> Tensor:
        return backend.run(
            q, k, v, mask, causal=causal, scale=scale, score_fn=None, dropout_p=0.0, bias=bias, need_weights=False
        )[0]

    if not wanted or not torch.is_grad_enabled():

        def run() -> object:
            with torch.no_grad():
                return forward()

        return run

    def run_with_backward() -> object:
        with torch.enable_grad():
            output = forward()
            return torch.autograd.grad(output, wanted, torch.ones_like(output))  # dense, as a loss's

    return run_with_backward


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
        score_fn, scale, upcast=q.dtype in _HALF_DTYPES or k.dtype in _HALF_DTYPES, keep_scale=bias is not None
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
        soft = _softmax_attention(
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
    "softmax": _softmax_attention,
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
        scores_of = lambda q, k: _dot_scores(q, k, scale)  # noqa: E731
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


def _full_mask(mask: Tensor | None, causal: bool, t_q: int, t_k: int, device: torch.device) -> Tensor | None:
    """The mask with the causal constraint folded in (materialised only when needed). A single query
    is the last position: causal or not, it may see every key."""
    return combine_masks(mask, causal_mask(t_q, t_k, device=device) if causal and t_q > 1 else None)


def _dot_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., T_q, T_k)


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
