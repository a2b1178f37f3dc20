"""Named sites and hooks: the one way to read or change what a model computes.

Every tensor worth observing inside a forward pass is a named *site*; a *hook* on a site is a
function, tensor in, tensor out, that the forward pass calls and goes on with what it returns.
Everything that observes or intervenes is hooks on sites:

* :func:`attnlab.nn.trace.trace` caches sites and edits them (replace, add, scale, any function)
  on a slice, or runs a module in place of a site (an SAE, a transcoder:
  :mod:`attnlab.nn.replacement`); every attention call's weights and head outputs are its
  ``*.attn.pattern`` and ``*.attn.z`` sites;
* :func:`attnlab.nn.head_masks.masking_heads` applies Michel §2.3's head mask xi: a scale of each
  ``*.attn.z``, xi_h head_h before W^O, differentiable in xi (head importance is dL/dxi_h);
* :func:`add_hook` (this module) is the primitive they all use.

This module holds the sites, their names and the primitive; :mod:`attnlab.nn.trace` and
:mod:`attnlab.nn.head_masks` what is built on them.

Site names are ``STACK.LAYER.POINT`` inside a layer, ``STACK.POINT`` for a stack's embedding and
final norm, and ``logits`` for the model's output. ``STACK`` is ``encoder`` or ``decoder`` (an
encoder-decoder has both; a decoder-only language model's one stack is ``decoder``, an encoder
classifier's or BERT's ``encoder``)::

    name                      shape                  what it is
    STACK.embed               (B, T, d_tok)          s E[x_i], the scaled token embedding
    STACK.pos_embed           (B, T, d_model)        p_i added to it (added encodings only)
    STACK.embed_norm.scale    (B, T, 1)              the embedding's norm (BERT): its scale and
    STACK.embed_norm.normalized (B, T, d_model)      normalised input (see below)
    STACK.L.resid_pre         (B, T, d_model)        the residual stream entering layer L
    STACK.L.attn_norm.scale   (B, T, 1)              the norm around self-attention: sqrt(mean(c^2)
                                                     + eps), c = x - mean(x) (LayerNorm) or x (RMSNorm)
    STACK.L.attn_norm.normalized (B, T, d_model)     c / scale, before the gain g (and bias b)
    STACK.L.attn.q_pre        (B, H, T_q, d_k)       queries before rotary positions (after q/k norms)
    STACK.L.attn.k_pre        (B, H_kv, T, d_k)      this call's keys before rotary positions
    STACK.L.attn.q            (B, H, T_q, d_k)       queries (after q/k norms and rotary positions)
    STACK.L.attn.k, .v        (B, H_kv, T_k, d_k|v)  keys, values (a KV cache's included)
    STACK.L.attn.scores       (B, H, T_q, T_k)       scale q.k (soft-capped, + position bias), before
                                                     mask and a(.)
    STACK.L.attn.pattern      (B, H, T_q, T_k)       attention weights a(scores)
    STACK.L.attn.z            (B, H, T_q, d_v)       xi_h head_h, each head's output before W^O
    STACK.L.attn.result       (B, H, T_q, d_model)   xi_h head_h W_o^h, each head's contribution
                                                     to the residual (Michel §2.2's Att_h terms)
    STACK.L.attn.out          (B, T_q, d_model)      sum_h result_h + b^O, the attention output
    STACK.L.attn_norm.post_scale, .post_normalized   the sandwich placement's norm of the output
    STACK.L.resid_mid         (B, T, d_model)        after the self-attention's Add & Norm (parallel
                                                     residuals: x + attention branch)
    STACK.L.cross.*           as attn.*              encoder-decoder attention (decoder layers)
    STACK.L.cross_norm.*      as attn_norm.*         the norm around it
    STACK.L.resid_cross       (B, T, d_model)        after the cross-attention's Add & Norm
    STACK.L.ffn_norm.*        as attn_norm.*         the norm around the FFN
    STACK.L.ffn.pre           (B, T, d_ff)           x W_1 + b_1, before the activation (ungated)
    STACK.L.ffn.gate, .up     (B, T, d_ff)           x W_gate, x W_up of a gated FFN (SwiGLU, GeGLU)
    STACK.L.ffn.hidden        (B, T, d_ff)           act(x W_1 + b_1), the FFN's hidden layer
    STACK.L.ffn.out           (B, T, d_model)        the FFN's output
    STACK.L.resid_post        (B, T, d_model)        after the FFN's Add & Norm: layer L's output
    STACK.final_norm.scale, .normalized              the final norm's parts (pre-norm stacks)
    STACK.final_norm          (B, T, d_model)        the stack's output (after the final norm of
                                                     a pre-norm stack): the input of the output
                                                     layer (the unembedding) of a language model
                                                     and of an encoder-decoder
    pooled                    (B, d_model)           the classifier's input (an encoder classifier)
    logits                    (B, T, V) or (B, C)    the model's output, soft-capped where the config
                                                     says (not for encoder-only)

The norm sites are TransformerLens's ``ln.hook_scale`` and ``ln.hook_normalized``: a norm's output
is gain(normalized) (:class:`attnlab.nn.normalization.Norm`); they sit where the placement puts the
norm (before its sub-layer for pre-norm and sandwich placements, after it for post-norm and
``output``; a post-norm layer's ``normalized`` is that of x + Sublayer(x)). The q/k norms inside
attention have no such sites. ``q_pre`` and ``k_pre`` equal ``q`` and ``k`` in a model without
rotary positions; an edit of ``k_pre`` reaches what a KV cache keeps (it is before the cache), one
of ``k`` only this call's keys.

A lone :class:`~attnlab.nn.MultiHeadAttention` has the sites ``attn.POINT``. Heads are axis 1 of
the head sites. An attention site's *kind* is what a head mask and a head's name
(:mod:`attnlab.head_ids`, ``kind:layer:head``) call it: ``encoder_self`` / ``decoder_self`` for the
``attn`` sites of an encoder-decoder's stacks, ``cross`` for its ``cross`` sites, ``self`` for the
``attn`` sites of a decoder-only model, an encoder classifier or an encoder.

How a site is computed: every module that owns sites has a ``hooks`` table, point -> the hooks
in the order they run; a forward pass runs them on the site's tensor. Empty, the table costs one
truth test per module call and the fused paths run as without it. Hooking ``scores`` or
``pattern`` computes the weights explicitly; ``result`` computes the per-head products with W^O;
a norm's ``scale`` or ``normalized`` computes that norm in parts; ``pre``, ``gate`` or ``up`` the
FFN's activation by PyTorch's operations; every other site leaves the fused paths as they are.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.errors import ModelRequestError

__all__ = [
    "Hook",
    "Site",
    "model_sites",
    "site_shapes",
    "resolve_sites",
    "add_hook",
    "ATTENTION_POINTS",
    "HEAD_POINTS",
]

Hook = Callable[[Tensor], Tensor]
"""What a site calls: its tensor in, the tensor the model goes on with out."""

ATTENTION_POINTS = ("q_pre", "k_pre", "q", "k", "v", "scores", "pattern", "z", "result", "out")
"""The points of an attention module, in the order it computes them."""

HEAD_POINTS = frozenset({"q_pre", "k_pre", "q", "k", "v", "scores", "pattern", "z", "result"})
"""Points with a head axis (axis 1). ``k`` and ``v`` have the key/value heads (grouped-query
attention: fewer than the query heads)."""

NORM_POINTS = ("scale", "normalized")
"""The points of a norm (before the gain), in the order they are computed."""


def run_hooks(hooks: dict[str, list[Hook]], point: str, x: Tensor) -> Tensor:
    """``x`` through the hooks at ``point``, in order (call only when ``hooks`` is not empty)."""
    for hook in hooks.get(point, ()):
        x = hook(x)
    return x


# ---- sites ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Site:
    """One named site of a model.

    Attributes:
        name: ``STACK.LAYER.POINT`` (see the module docstring).
        module: the module whose ``hooks`` hold the site's hooks (for an attention site, the
            :class:`~attnlab.nn.MultiHeadAttention`).
        point: the key in ``module.hooks``.
        stack: ``encoder`` or ``decoder``; None for ``logits`` and a lone attention module's sites.
        layer: the layer index, or None outside layers.
        kind: the attention kind of an attention site (``self``, ``encoder_self``, ...), else None.
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

    @property
    def prefix(self) -> str:
        """The name without its point: ``decoder.3.attn`` for ``decoder.3.attn.z``."""
        return self.name[: -len(self.point) - 1] if self.name != self.point else ""


def model_sites(model: nn.Module) -> dict[str, Site]:
    """Every site of an attnlab model, by name, in the order a forward pass reaches them.

    Args:
        model: a model with ``site_stacks()`` (every :class:`attnlab.nn.TransformerModel`), or a
            lone attention module (sites ``attn.POINT``, kind ``self``, layer 0).

    Returns:
        name -> :class:`Site`.
    """
    sites: dict[str, Site] = {}

    def add(name: str, module: nn.Module, point: str, stack: str | None, layer: int | None, **axes) -> None:
        sites[name] = Site(name, module, point, stack, layer, axes.get("kind"), axes.get("head"), axes.get("pos", 1))

    def add_attention(prefix: str, module: nn.Module, stack: str | None, layer: int | None, kind: str) -> None:
        for point in module.site_points:  # a bridged module has no q_pre / k_pre (attnlab.pretrained.bridge)
            head = 1 if point in HEAD_POINTS else None
            add(f"{prefix}.{point}", module, point, stack, layer, kind=kind, head=head, pos=2 if head else 1)

    def add_norm(prefix: str, label: str, norm: nn.Module, stack: str, layer: int, when: int) -> None:
        for point in norm.site_points[when]:  # an Add & Norm's points before (0) or after (1) its sub-layer
            add(f"{prefix}.{label}_norm.{point}", norm, point, stack, layer)

    if not hasattr(model, "site_stacks"):
        if getattr(model, "site_points", None) != ATTENTION_POINTS:
            raise TypeError(f"{type(model).__name__} has no named sites (site_stacks()); an attnlab model has")
        add_attention("attn", model, None, 0, "self")
        return sites
    for stack, (stack_module, kinds) in model.site_stacks().items():
        embedding = stack_module.embedding
        add(f"{stack}.embed", embedding, "embed", stack, None)
        if embedding.adds_positions:
            add(f"{stack}.pos_embed", embedding, "pos_embed", stack, None)
        for point in embedding.norm_points:
            add(f"{stack}.{point}", embedding, point, stack, None)
        for index, layer in enumerate(stack_module.layers):
            prefix = f"{stack}.{index}"
            add(f"{prefix}.resid_pre", layer, "resid_pre", stack, index)

            attentions = [("attn", layer.self_attn, kinds[0], "resid_mid", layer.site_norms[0])]
            if layer.self_attn is None:  # a hybrid's layer without attention (bridged models)
                attentions = []
            if hasattr(layer, "cross_attn"):
                attentions.append(("cross", layer.cross_attn, kinds[1], "resid_cross", layer.site_norms[1]))
            for label, module, kind, after, norm in attentions:
                add_norm(prefix, label, norm, stack, index, 0)
                add_attention(f"{prefix}.{label}", module, stack, index, kind)
                add_norm(prefix, label, norm, stack, index, 1)
                if after in getattr(layer, "residual_points", (after,)):
                    add(f"{prefix}.{after}", layer, after, stack, index)
            add_norm(prefix, "ffn", layer.ffn_norm, stack, index, 0)
            for point in layer.feed_forward.site_points:
                add(f"{prefix}.ffn.{point}", layer.feed_forward, point, stack, index)
            add_norm(prefix, "ffn", layer.ffn_norm, stack, index, 1)
            add(f"{prefix}.resid_post", layer, "resid_post", stack, index)
        for point in stack_module.final_norm_points:
            add(f"{stack}.{point}", stack_module, point, stack, None)
        add(f"{stack}.final_norm", stack_module, "final_norm", stack, None)
    if model.has_pooled_site:
        add("pooled", model, "pooled", None, None, pos=None)
    if model.has_logits_site:
        add("logits", model, "logits", None, None, pos=model.logits_position_axis)
    return sites


def attention_sites(model: nn.Module) -> list[Site]:
    """One site per attention module, its ``z`` (kind, layer and module are the module's), in the
    order a forward pass reaches them; as :func:`model_sites` names them, without building the rest."""
    if not hasattr(model, "site_stacks"):
        return [site for site in model_sites(model).values() if site.point == "z"]
    sites = []
    for stack, (stack_module, kinds) in model.site_stacks().items():
        for index, layer in enumerate(stack_module.layers):
            attentions = [("attn", layer.self_attn, kinds[0])] if layer.self_attn is not None else []
            if hasattr(layer, "cross_attn"):
                attentions.append(("cross", layer.cross_attn, kinds[1]))
            for label, module, kind in attentions:
                sites.append(Site(f"{stack}.{index}.{label}.z", module, "z", stack, index, kind, 1, 2))
    return sites


def resolve_sites(sites: dict[str, Site], patterns: Iterable[str]) -> list[str]:
    """The site names matching ``patterns`` (names or shell-style globs such as ``*.attn.z``), in
    the model's order.

    Raises:
        ModelRequestError: a pattern that matches no site, naming the closest site names, or no string
            (a UsageError and a ValueError).
    """
    if isinstance(patterns, str) or not isinstance(patterns, Iterable):
        patterns = [patterns]  # type: ignore[list-item]
    chosen: set[str] = set()
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ModelRequestError(
                f"site: a site name or glob (a string, see `attnlab sites`) is needed, got {pattern!r}"
            )
        matched = fnmatch.filter(sites, pattern) if any(c in pattern for c in "*?[") else [pattern] * (pattern in sites)
        if not matched:
            close = difflib.get_close_matches(pattern, list(sites), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(list(sites)[:3])}"
            raise ModelRequestError(f"site {pattern!r}: no such site in this model{hint}")
        chosen.update(matched)
    return [name for name in sites if name in chosen]


# ---- the primitive ----------------------------------------------------------------------------


def add_hook(site: Site, hook: Hook, *, first: bool = False) -> Callable[[], None]:
    """Run ``hook`` at ``site`` on every forward pass, after the site's other hooks (before them
    with ``first``); returns the function that removes it.

    When the last hook of a module is removed its table is empty again, and the module runs as
    if it had never been hooked.
    """
    table = site.module.hooks
    chain = table.setdefault(site.point, [])
    chain.insert(0, hook) if first else chain.append(hook)

    def remove() -> None:
        chain = table.get(site.point, [])
        for index, other in enumerate(chain):
            if other is hook:
                del chain[index]
                break
        if not chain:
            table.pop(site.point, None)

    return remove


def site_shapes(model: nn.Module, length: int = 5) -> dict[str, tuple[Site, str]]:
    """Every site of ``model`` with its shape, read from one forward pass on ``length`` tokens.

    Returns:
        name -> (site, shape as text), e.g. ``"(B, 12, T, 32)"``: B the batch, T the positions,
        T_k the keys of ``scores`` and ``pattern``.
    """
    shapes: dict[str, str] = {}

    def record(site: Site) -> Hook:
        def hook(x: Tensor) -> Tensor:
            shapes[site.name] = _shape_text(site, x)
            return x

        return hook

    sites = model_sites(model)
    removers = [add_hook(site, record(site)) for site in sites.values()]
    try:
        with torch.no_grad():
            model(*model.example_inputs(length))
    finally:
        for remove in removers:
            remove()
    return {name: (site, shapes[name]) for name, site in sites.items() if name in shapes}


def _shape_text(site: Site, x: Tensor) -> str:
    dims: list[object] = list(x.shape)
    dims[0] = "B"
    if site.position_axis is not None:
        dims[site.position_axis] = "T"
    if site.point in ("scores", "pattern", "k", "v"):
        dims[-1 if site.point in ("scores", "pattern") else 2] = "T_k"
    return "(" + ", ".join(map(str, dims)) + ")"
