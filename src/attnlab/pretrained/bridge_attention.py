"""attnlab's attention function inside transformers' own modules: the bridge's named attention sites.

Since v4.48 every modern model of transformers computes attention through one registry,
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`` (its ``AttentionInterface``): the
model's module projects queries, keys and values, applies its positions, and calls the function
with them per head; the function returns each head's output, before the output projection W^O.
That is exactly where attnlab's attention sites live, so a model opened through the bridge
(:mod:`attnlab.pretrained.bridge`) is built with ``attn_implementation="attnlab"``, the function
:func:`attention` registered under that name (with transformers' SDPA mask function, boolean
masks, True where a query may attend, attnlab's convention).

The formula (Vaswani §3.2.1, with the variants transformers passes in its keyword arguments)::

    scores_h = scale q_h k_h^T        (Gemma 2: c tanh(scores / c); T5: + position bias)
    pattern_h = softmax(scores_h masked)   (gpt-oss: a learned sink logit per head in the softmax,
                                            dropped from the pattern, so rows sum below 1)
    z_h = pattern_h v_h

With no site hooked (and no soft cap or sink, which SDPA cannot compute) the function is
transformers' own SDPA path, :func:`transformers.integrations.sdpa_attention.sdpa_attention_forward`;
the explicit scores and pattern are computed only for a layer whose ``scores`` or ``pattern``
is hooked. ``q``, ``k``, ``v`` and ``z`` hooks run on either path (``z`` is where Michel et al.'s
head mask xi scales each head).

Shape:
    query: (B, H, T_q, d_k);  key, value: (B, H_kv, T_k, d_k|v);  attention_mask: (B, 1, T_q, T_k)
    bool or additive float, or None (causal where the module is);  returns (B, T_q, H, d_v) and
    the pattern (B, H, T_q, T_k) where it was computed (else None), as transformers' functions do.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn.hooks import run_hooks

__all__ = ["IMPLEMENTATION", "attention", "explicit_attention", "register"]

IMPLEMENTATION = "attnlab"
"""The name of attnlab's function in transformers' attention and mask registries."""

SITE_ATTRIBUTE = "_attnlab_site"
"""The attribute of a transformers attention module that holds its sites (a ``BridgedAttention``)."""


def register() -> None:
    """Register :func:`attention` (and SDPA's boolean masks) under :data:`IMPLEMENTATION` in
    transformers' registries, transformers' documented way to add an attention function. Only
    models built with ``attn_implementation="attnlab"`` call it; idempotent."""
    from transformers import AttentionInterface  # lazy: transformers is imported only by the bridge
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(IMPLEMENTATION, attention)
    AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention call with attnlab's sites (see the module docstring)."""
    site = getattr(module, SITE_ATTRIBUTE, None)
    hooks = {} if site is None else site.hooks
    if site is not None and site.probe is not None:  # the bridge's first pass, finding the parts
        probe, site.probe = site.probe, None
        try:
            output, pattern = attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
        finally:
            site.probe = probe
        probe(query, key, value, output)
        return output, pattern
    if hooks:
        query = run_hooks(hooks, "q", query) if "q" in hooks else query
        key = run_hooks(hooks, "k", key) if "k" in hooks else key
        value = run_hooks(hooks, "v", value) if "v" in hooks else value
    explicit = (
        "scores" in hooks
        or "pattern" in hooks
        or kwargs.get("softcap")
        or kwargs.get("s_aux") is not None
        or getattr(site, "explicit", False)
    )
    if explicit:
        z, pattern = explicit_attention(module, query, key, value, attention_mask, dropout, scaling, hooks, **kwargs)
    else:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # lazy, as in register

        output, _ = sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout if module.training else 0.0,
            scaling=scaling,
            **kwargs,
        )
        if "z" not in hooks:
            return output, None
        z, pattern = output.transpose(1, 2), None
    if "z" in hooks:
        z = run_hooks(hooks, "z", z)
    return z.transpose(1, 2).contiguous(), pattern


def explicit_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float,
    scaling: float | None,
    hooks: dict[str, Any],
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """The formula of the module docstring step by step, with the ``scores`` and ``pattern`` sites.

    Returns:
        z (B, H, T_q, d_v) and the pattern (B, H, T_q, T_k).
    """
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:  # grouped-query attention: each key/value head serves H / H_kv query heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    cap = kwargs.get("softcap")
    if cap:
        scores = torch.tanh(scores / cap) * cap
    bias = kwargs.get("position_bias")
    if bias is not None:
        scores = scores + bias
    if "scores" in hooks:
        scores = run_hooks(hooks, "scores", scores)
    scores = _masked(module, scores, attention_mask, kwargs.get("is_causal"))
    sinks = kwargs.get("s_aux")
    wide = torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else scores.dtype
    if sinks is not None:  # gpt-oss: one learned logit per head joins every row's softmax
        sink = sinks.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1).to(scores.dtype)
        joined = torch.cat([scores, sink], dim=-1)
        joined = joined - joined.max(dim=-1, keepdim=True).values
        pattern = F.softmax(joined, dim=-1, dtype=wide)[..., :-1].to(query.dtype)
    else:
        pattern = F.softmax(scores, dim=-1, dtype=wide).to(query.dtype)
    if module.training and dropout:
        pattern = F.dropout(pattern, p=dropout, training=True)
    if "pattern" in hooks:
        pattern = run_hooks(hooks, "pattern", pattern)
    return torch.matmul(pattern, value), pattern


def _masked(module: nn.Module, scores: Tensor, mask: Tensor | None, is_causal: bool | None) -> Tensor:
    """``scores`` where a query may attend, the dtype's lowest value elsewhere (a row with no key
    left, a padding query's, attends uniformly rather than to NaN, as transformers' eager path)."""
    lowest = torch.finfo(scores.dtype).min
    if mask is None:
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        t_q, t_k = scores.shape[-2:]
        if not causal or t_q == 1:
            return scores
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=scores.device).tril(t_k - t_q)
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask[..., : scores.shape[-1]], lowest)
    return scores + mask[..., : scores.shape[-1]]
