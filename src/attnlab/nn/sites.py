"""Named activation sites: one vocabulary of the tensors every attnlab model computes.

A site is a tensor inside the forward pass that can be read (cached) or edited (replaced, added
to, scaled) by :func:`attnlab.analysis.trace.trace`. Its name is ``STACK.LAYER.POINT`` inside a
layer, ``STACK.POINT`` for a stack's embedding and final norm, and ``logits`` for the model's
output. ``STACK`` is ``encoder`` or ``decoder`` (an encoder-decoder has both; a decoder-only
language model's one stack is ``decoder``, an encoder classifier's or BERT's ``encoder``)::

    name                      shape                  what it is
    STACK.embed               (B, T, d_tok)          s E[x_i], the scaled token embedding
    STACK.pos_embed           (B, T, d_model)        p_i added to it (added encodings only)
    STACK.L.resid_pre         (B, T, d_model)        the residual stream entering layer L
    STACK.L.attn.q            (B, H, T_q, d_k)       queries (after rotary positions)
    STACK.L.attn.k, .v        (B, H_kv, T_k, d_k|v)  keys, values (a KV cache's included)
    STACK.L.attn.scores       (B, H, T_q, T_k)       scale q.k (+ position bias), before mask and a(.)
    STACK.L.attn.pattern      (B, H, T_q, T_k)       attention weights a(scores)
    STACK.L.attn.z            (B, H, T_q, d_v)       xi_h head_h, each head's output before W^O
    STACK.L.attn.result       (B, H, T_q, d_model)   xi_h head_h W_o^h, each head's contribution
                                                     to the residual (Michel §2.2's Att_h terms)
    STACK.L.attn.out          (B, T_q, d_model)      sum_h result_h + b^O, the attention output
    STACK.L.resid_mid         (B, T, d_model)        after the self-attention's Add & Norm
    STACK.L.cross.*           as attn.*              encoder-decoder attention (decoder layers)
    STACK.L.resid_cross       (B, T, d_model)        after the cross-attention's Add & Norm
    STACK.L.ffn.hidden        (B, T, d_ff)           act(x W_1 + b_1), the FFN's hidden layer
    STACK.L.ffn.out           (B, T, d_model)        the FFN's output
    STACK.L.resid_post        (B, T, d_model)        after the FFN's Add & Norm: layer L's output
    STACK.final_norm          (B, T, d_model)        the stack's output (after the final norm of
                                                     a pre-norm stack)
    logits                    (B, T, V) or (B, C)    the model's output (not for encoder-only)

Heads are axis 1 of the head sites; ``attn`` heads are those of the attention kind the head mask
names ``encoder_self``/``decoder_self`` (encoder-decoder) or ``self``, ``cross`` those of ``cross``.

How a site is computed: every module that owns sites has a ``taps`` dict, point -> function; a
forward pass calls the function on the site's tensor and goes on with what it returns. Empty, it
costs one truth test per module call. Reading ``scores`` or ``pattern`` computes the weights
explicitly (as :func:`attnlab.nn.capture` does); ``result`` computes the per-head products with
W^O; every other site leaves the fused attention path as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["Site", "Tap", "tap", "model_sites", "site_shapes", "HEAD_POINTS", "ATTENTION_POINTS"]

Tap = Callable[[Tensor], Tensor]
"""What a site calls: its tensor in, the tensor the model goes on with out."""

ATTENTION_POINTS = ("q", "k", "v", "scores", "pattern", "z", "result", "out")
"""The points of an attention module, in the order it computes them."""

HEAD_POINTS = frozenset({"q", "k", "v", "scores", "pattern", "z", "result"})
"""Points with a head axis (axis 1). ``k`` and ``v`` have the key/value heads (grouped-query
attention: fewer than the query heads)."""

LAYER_POINTS = ("resid_pre", "resid_mid", "resid_cross", "resid_post")
FFN_POINTS = ("hidden", "out")
EMBEDDING_POINTS = ("embed", "pos_embed")


def tap(taps: dict[str, Tap], point: str, x: Tensor) -> Tensor:
    """``x`` through the function at ``point``, if any (call only when ``taps`` is not empty)."""
    function = taps.get(point)
    return x if function is None else function(x)


@dataclass(frozen=True)
class Site:
    """One named site of a model.

    Attributes:
        name: ``STACK.LAYER.POINT`` (see the module docstring).
        module: the module whose ``taps`` hold the site's function.
        point: the key in ``module.taps``.
        stack: ``encoder`` or ``decoder``; None for ``logits``.
        layer: the layer index, or None outside layers.
        kind: the head-mask kind of an attention site (``self``, ``encoder_self``, ...), else None.
        head_axis: 1 for a site with a head axis, else None.
        position_axis: the axis of the (query) positions, or None (``logits`` of a classifier).
    """

    name: str
    module: nn.Module
    point: str
    stack: str | None
    layer: int | None
    kind: str | None
    head_axis: int | None
    position_axis: int | None


def model_sites(model: nn.Module) -> dict[str, Site]:
    """Every site of an attnlab model, by name, in the order a forward pass reaches them.

    Args:
        model: a model with ``site_stacks()`` (every :class:`attnlab.nn.TransformerModel`).

    Returns:
        name -> :class:`Site`.
    """
    if not hasattr(model, "site_stacks"):
        raise TypeError(f"{type(model).__name__} has no named sites (site_stacks()); an attnlab model has")
    sites: dict[str, Site] = {}

    def add(name: str, module: nn.Module, point: str, stack: str | None, layer: int | None, **axes) -> None:
        sites[name] = Site(name, module, point, stack, layer, axes.get("kind"), axes.get("head"), axes.get("pos", 1))

    for stack, (body, kinds) in model.site_stacks().items():
        embedding = body.embedding
        add(f"{stack}.embed", embedding, "embed", stack, None)
        if embedding.adds_positions:
            add(f"{stack}.pos_embed", embedding, "pos_embed", stack, None)
        for index, layer in enumerate(body.layers):
            prefix = f"{stack}.{index}"
            add(f"{prefix}.resid_pre", layer, "resid_pre", stack, index)
            attentions = [("attn", layer.self_attn, kinds[0], "resid_mid")]
            if hasattr(layer, "cross_attn"):
                attentions.append(("cross", layer.cross_attn, kinds[1], "resid_cross"))
            for label, module, kind, after in attentions:
                for point in ATTENTION_POINTS:
                    head = 1 if point in HEAD_POINTS else None
                    add(
                        f"{prefix}.{label}.{point}",
                        module,
                        point,
                        stack,
                        index,
                        kind=kind,
                        head=head,
                        pos=2 if head else 1,
                    )
                add(f"{prefix}.{after}", layer, after, stack, index)
            for point in FFN_POINTS:
                add(f"{prefix}.ffn.{point}", layer.feed_forward, point, stack, index)
            add(f"{prefix}.resid_post", layer, "resid_post", stack, index)
        add(f"{stack}.final_norm", body, "final_norm", stack, None)
    if model.has_logits_site:
        add("logits", model, "logits", None, None, pos=model.logits_position_axis)
    return sites


def site_shapes(model: nn.Module, length: int = 5) -> dict[str, tuple[Site, str]]:
    """Every site of ``model`` with its shape, read from one forward pass on ``length`` tokens.

    Returns:
        name -> (site, shape as text), e.g. ``"(B, 12, T, 32)"``: B the batch, T the positions,
        T_k the keys of ``scores`` and ``pattern``.
    """
    sites = model_sites(model)
    shapes: dict[str, str] = {}
    before = {name: site.module.taps.get(site.point) for name, site in sites.items()}  # an enclosing trace's
    for site in sites.values():

        def record(x: Tensor, site: Site = site) -> Tensor:
            shapes[site.name] = _shape_text(site, x)
            return x

        site.module.taps[site.point] = record
    try:
        with torch.no_grad():
            model(*model.example_inputs(length))
    finally:
        for name, site in sites.items():
            if before[name] is None:
                site.module.taps.pop(site.point, None)
            else:
                site.module.taps[site.point] = before[name]
    return {name: (site, shapes[name]) for name, site in sites.items() if name in shapes}


def _shape_text(site: Site, x: Tensor) -> str:
    dims: list[object] = list(x.shape)
    dims[0] = "B"
    if site.position_axis is not None:
        dims[site.position_axis] = "T"
    if site.point in ("scores", "pattern", "k", "v"):
        dims[-1 if site.point in ("scores", "pattern") else 2] = "T_k"
    return "(" + ", ".join(map(str, dims)) + ")"
