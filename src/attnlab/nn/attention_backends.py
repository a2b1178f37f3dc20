"""Soft attention's implementations, and the one place that picks among them.

    softmax(mask(scale Q K^T + bias)) V                           (Vaswani et al. §3.2.1, Eq. 1)

computed by one of :data:`BACKENDS`, each an implementation of the same formula whose ``applies``
predicate says which calls it takes:

* ``explicit``: the formula step by step (:func:`softmax_explicit`: scores, mask, softmax,
  weighted sum); the only one that returns the weights or takes a custom score function;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (O(T) memory);
* ``short`` and ``decode``: attnlab's C++ CPU kernels for short heads and for a decoding step's few
  queries (:mod:`attnlab.kernels`).

:func:`softmax_attention` runs the one :func:`select_backend` picks for a call, under the *setting*
the caller resolved once (:data:`BACKEND_SETTINGS`: a module's ``backend``, chosen when it is built
from ``[runtime] attention``, ``attnlab.load(attention=)`` or the documented override
``ATTNLAB_BACKEND``): a backend's name forces it wherever it applies; ``native`` forces attnlab's
kernels; ``auto`` takes, on a CPU where several apply, the choice of the model's kernel record
(:mod:`attnlab.kernels.calibration`: the first that applies in ``fixed`` mode, the fastest timed on
this machine in ``measured`` mode), and off the CPU the first that applies.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab import kernels
from attnlab.errors import ConfigError
from attnlab.kernels import calibration
from attnlab.nn.masks import causal_mask, combine_masks

__all__ = [
    "softmax_attention",
    "softmax_explicit",
    "BACKENDS",
    "BACKEND_SETTINGS",
    "FORCED",
    "OVERRIDE",
    "Backend",
    "backend_setting",
    "select_backend",
    "ScoreFn",
    "full_mask",
    "dot_scores",
    "HALF_DTYPES",
]

ScoreFn = Callable[[Tensor, Tensor], Tensor]
"""Maps queries (..., T_q, d_k) and keys (..., T_k, d_k) to scores (..., T_q, T_k)."""

# --------------------------------------------------------------------------------------------
# softmax_attention: the backend select_backend picks
# --------------------------------------------------------------------------------------------


def softmax_attention(
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
    """softmax(mask(scale Q K^T + bias)) V  (Vaswani Eq. 1), by the one of :data:`BACKENDS` that
    :func:`select_backend` picks for the call under ``backend`` (a setting of :data:`BACKEND_SETTINGS`,
    resolved by the caller once); :func:`softmax_explicit` is the formula step by step.

    Shape:
        q: (..., T_q, d_k);  k: (..., T_k, d_k);  v: (..., T_k, d_v);  returns (..., T_q, d_v) and
        the weights (..., T_q, T_k) where ``need_weights``, else None.
    """
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
    override ``ATTNLAB_BACKEND`` or ``auto``) where it forces a backend that applies; else the only one
    that applies; else, on a CPU, the kernel record's choice for the call's shape class (the first
    that applies in ``fixed`` mode, else the one measured fastest (device,
    dtype, whether a gradient is wanted, mask, bias, causal, and T_q, T_k, d_k, d_v and the rows
    of (batch x head) rounded up to powers of two), timed once per machine by
    :mod:`attnlab.kernels.calibration` on the call's own tensors; else (off the CPU, with dropout,
    whose random draws the timing must not consume, or scores too large to time cheaply) the
    first that applies of ``decode``, ``short``, ``sdpa``, ``explicit``.
    """
    if backend is None:
        backend = backend_setting()
    if backend != "auto":
        forced = FORCED.get(backend)
        if forced is None:
            backend_setting(backend)  # a ConfigError naming the setting
        for each in forced:
            if each.applies(q, k, v, mask, bias, dropout_p, need_weights, score_fn):
                return each
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
    if key is None:
        return applicable[0]
    if len(applicable) == 1 or not calibration.can_measure():
        return BACKENDS[calibration.first(key, [each.name for each in applicable])]
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
    mask = full_mask(mask, causal, t_q, t_k, q.device)
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
    """The formula step by step: scores, mask, softmax, weighted sum (:func:`softmax_explicit`)."""
    output, weights = softmax_explicit(
        q, k, v, mask, causal=causal, scale=scale, score_fn=score_fn, dropout_p=dropout_p, bias=bias
    )
    return output, weights if need_weights else None


def softmax_explicit(
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
    if q.dtype in HALF_DTYPES or k.dtype in HALF_DTYPES or v.dtype in HALF_DTYPES:
        return _in_float32(q, k, v, mask, causal=causal, scale=scale, score_fn=score_fn, dropout_p=dropout_p, bias=bias)
    scores = score_fn(q, k) if score_fn is not None else dot_scores(q, k, scale)  # (..., T_q, T_k)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)
    mask = full_mask(mask, causal, q.shape[-2], k.shape[-2], q.device)
    if mask is not None:
        # finfo.min, not -inf: a fully masked row then stays finite, and `* mask` zeroes it.
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(v.dtype)
    if mask is not None:
        weights = weights * mask
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    return torch.matmul(dropped, v), weights


HALF_DTYPES = (torch.float16, torch.bfloat16)


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
    output, weights = softmax_explicit(
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


FORCED: dict[str, tuple[Backend, ...]] = {
    **{name: (backend,) for name, backend in BACKENDS.items()},
    "native": (BACKENDS["decode"], BACKENDS["short"]),
}
"""A setting other than ``auto`` -> the backends it forces, the first that applies taken: a
backend's own name, or ``native`` for attnlab's C++ kernels (a decoding step's, then short heads')."""

BACKEND_SETTINGS = ("auto", *FORCED)
"""The values of a backend setting (``[runtime] attention``, ``attnlab.load(attention=)``,
``MultiHeadAttention(backend=...)``, :func:`attnlab.nn.attention.attention`'s ``backend``, the
override ``ATTNLAB_BACKEND``): ``auto``, the kernel record's choice, or a key of :data:`FORCED`."""

OVERRIDE = os.environ.get("ATTNLAB_BACKEND") or None
"""The documented override ``ATTNLAB_BACKEND``, read once, when this module is imported: the
setting of every module built without one, and of :func:`attnlab.nn.attention.attention` called
without ``backend=``."""


def backend_setting(name: str | None = None) -> str:
    """``name`` checked against :data:`BACKEND_SETTINGS`; None: the override :data:`OVERRIDE` where it
    is set, else ``auto``. A model's attention calls this once, when it is built; a ConfigError
    names the variable or the setting."""
    source = "attention backend"
    if name is None:
        name, source = OVERRIDE or "auto", "ATTNLAB_BACKEND"
    if name not in BACKEND_SETTINGS:
        raise ConfigError(f"{source}: unknown {name!r}; allowed: {', '.join(sorted(BACKEND_SETTINGS))}")
    return name


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


def full_mask(mask: Tensor | None, causal: bool, t_q: int, t_k: int, device: torch.device) -> Tensor | None:
    """The mask with the causal constraint folded in (materialised only when needed). A single query
    is the last position: causal or not, it may see every key."""
    return combine_masks(mask, causal_mask(t_q, t_k, device=device) if causal and t_q > 1 else None)


def dot_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    return torch.matmul(q, k.transpose(-2, -1)) * scale  # (..., T_q, T_k)
