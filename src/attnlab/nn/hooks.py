"""Named sites and hooks: the one way to read or change what a model computes.

Every tensor worth observing inside a forward pass is a named *site*; a *hook* on a site is a
function, tensor in, tensor out, that the forward pass calls and goes on with what it returns.
Everything that observes or intervenes is hooks on sites:

* :func:`trace` caches sites and edits them (replace, add, scale, any function) on a slice, or
  runs a module in place of a site (an SAE, a transcoder: :mod:`attnlab.nn.replacement`);
* :func:`capture` is a view of caching ``*.attn.pattern`` and ``*.attn.z`` at every call;
* :func:`masking_heads` applies Michel §2.3's head mask xi: a scale of each ``*.attn.z``, xi_h
  head_h before W^O, differentiable in xi (head importance is dL/dxi_h);
* :func:`add_hook` is the primitive they all use.

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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnlab.errors import UsageError
from attnlab.nn.replacement import Replacement

__all__ = [
    "Hook",
    "Site",
    "model_sites",
    "site_shapes",
    "resolve_sites",
    "add_hook",
    "Trace",
    "trace",
    "AttentionRecord",
    "capture",
    "HeadMask",
    "ATTENTION_KINDS",
    "head_mask_shapes",
    "check_head_mask",
    "full_head_mask",
    "masking_heads",
    "expert_mask_shape",
    "masking_experts",
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
        ValueError: a pattern that matches no site, naming the closest site names.
    """
    chosen: set[str] = set()
    for pattern in patterns:
        matched = fnmatch.filter(sites, pattern) if any(c in pattern for c in "*?[") else [pattern] * (pattern in sites)
        if not matched:
            close = difflib.get_close_matches(pattern, list(sites), n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(list(sites)[:3])}"
            raise ValueError(f"site {pattern!r}: no such site in this model{hint}")
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


# ---- tracing: cache and edit -------------------------------------------------------------------

Selection = int | Sequence[int] | Tensor | None
"""Indices along one axis (an int, a list or a 1-D tensor), or None for all of it."""


@dataclass
class _Handler:
    """What one trace does at one site: its edits in order, then recording."""

    site: Site
    cache: dict[str, Tensor]
    detach: bool
    edits: list[Hook] = field(default_factory=list)
    record: bool = False
    device: torch.device | None = None
    """Where the cached tensor is kept (None: where the site computed it, its layer's device)."""
    after: list[Hook] = field(default_factory=list)
    """Run last, on the value as cached: a module replacing the site, or reading it (:class:`Replacement`)."""

    def __call__(self, x: Tensor) -> Tensor:
        for edit in self.edits:
            x = edit(x)
        if self.record:
            kept = _own(x.detach() if self.detach else x)
            self.cache[self.site.name] = kept if self.device is None else kept.to(self.device)
        for hook in self.after:
            x = hook(x)
        return x


def _own(x: Tensor) -> Tensor:
    """``x``, or a copy of it where it is a view into a larger buffer (``v`` of the fused q|k|v
    projection): a cached site keeps alive its own bytes only, never the buffer around it."""
    return x.clone() if x.untyped_storage().nbytes() > x.numel() * x.element_size() else x


class Trace:
    """The sites of one traced model, what is cached from them, and the edits on them.

    Attributes:
        sites: every site of the model, by name (:func:`model_sites`), and the sub-sites of the
            modules that replace sites (:meth:`replace_with`).
        cache: site name -> its tensor in the latest forward pass, for the requested sites.
    """

    def __init__(self, model: nn.Module, *, detach: bool = True, device: str | torch.device | None = None) -> None:
        self.model = model
        self.sites = model_sites(model)
        self.cache: dict[str, Tensor] = {}
        self._detach = detach
        self._device = None if device is None else torch.device(device)
        self._handlers: dict[str, _Handler] = {}
        self._removers: list[Callable[[], None]] = []

    def record(self, patterns: str | Iterable[str]) -> list[str]:
        """Cache the sites matching ``patterns`` from now on; returns their names."""
        names = resolve_sites(self.sites, [patterns] if isinstance(patterns, str) else patterns)
        for name in names:
            self._handler(name).record = True
        return names

    def edit(
        self,
        site: str,
        function: Hook,
        *,
        examples: Selection = None,
        heads: Selection = None,
        positions: Selection = None,
    ) -> None:
        """Replace the site's value x by ``function(x)`` on the selected slice.

        Args:
            site: a site name (or a glob: the edit applies to every match).
            function: maps the site's whole tensor to one of the same shape; only its values on
                the selection are used.
            examples, heads, positions: the slice (see :data:`Selection`); ``heads`` needs a head
                site, ``positions`` a site with positions.
        """
        for name in resolve_sites(self.sites, [site]):
            selector = _selector(self.sites[name], examples, heads, positions)
            self._handler(name).edits.append(_edit_on(selector, function, name))

    def replace(self, site: str, value: Tensor | float, **selection: Selection) -> None:
        """Put ``value`` (broadcastable to the site's shape, e.g. another run's cached tensor, a mean
        over a dataset, or 0.0) in place of the site's value on the selection."""
        self.edit(site, lambda x: _as(value, x, site).expand_as(x), **selection)

    def add(self, site: str, value: Tensor | float, **selection: Selection) -> None:
        """Add ``value`` (broadcastable to the site's shape, e.g. a steering vector) on the selection."""
        self.edit(site, lambda x: x + _as(value, x, site), **selection)

    def scale(self, site: str, factor: Tensor | float, **selection: Selection) -> None:
        """Multiply the site's value by ``factor`` on the selection (0.0: zero ablation)."""
        self.edit(site, lambda x: x * _as(factor, x, site), **selection)

    def replace_with(
        self, site: str, module: nn.Module, *, keep_error: bool = False, reads: str | None = None
    ) -> list[str]:
        """Run ``module`` in place of the site, y -> module(y) (:class:`Replacement`), after the
        site's edits; ``SITE.features`` (a module with ``encode`` and ``decode``: an SAE, a
        transcoder), ``SITE.reconstruction`` and ``SITE.error`` become sites of this trace.

        Args:
            site: one site name.
            module: any ``nn.Module`` mapping the site's tensor to one of its shape.
            keep_error: go on with reconstruction + error, y until an edit (SAELens' use_error_term).
            reads: a site computed earlier that the module reads instead (a transcoder's MLP input).

        Returns:
            The names of the new sites.
        """
        replacement = Replacement(module, site, keep_error=keep_error, reads=reads)
        self.sites = replacement.splice(self.sites)
        self._handler(site).after.append(replacement)
        if reads is not None:
            self._handler(reads).after.append(replacement.read)
        return [f"{site}.{point}" for point in replacement.site_points]

    def _handler(self, name: str) -> _Handler:
        if name not in self._handlers:
            handler = self._handlers[name] = _Handler(self.sites[name], self.cache, self._detach, device=self._device)
            self._removers.append(add_hook(self.sites[name], handler))
        return self._handlers[name]

    def _remove(self) -> None:
        for remove in reversed(self._removers):
            remove()
        self._removers.clear()


@contextmanager
def trace(
    model: nn.Module,
    cache: str | Iterable[str] | None = None,
    *,
    detach: bool = True,
    device: str | torch.device | None = None,
    replace: Mapping[str, nn.Module] | None = None,
    keep_error: bool = False,
) -> Iterator[Trace]:
    """Trace ``model`` inside the block: cache the sites matching ``cache`` and apply the edits given
    to the yielded :class:`Trace`; on leaving, the model is as it was.

    An edit applies to a slice of its site chosen by ``examples`` (axis 0), ``heads`` (axis 1 of a
    head site) and ``positions`` (the query positions' axis); elsewhere the tensor passes
    unchanged. Edits of one site apply in the order given, after those of an enclosing trace, and
    after the head mask (:func:`masking_heads`): ``z`` and ``result`` are read after xi_h
    multiplies each head. The cache holds, for every requested site, the value the model went on
    with (after this trace's edits) in its latest forward pass inside the block.

    Activation patching (Vig et al. 2020; Meng et al. 2022) replaces a site's value on a
    "corrupt" input with its value on a "clean" one; mean ablation replaces it with its mean over
    a dataset; zero ablation of ``result`` for head h is Michel et al.'s xi_h = 0.

    Args:
        model: an attnlab model (:class:`attnlab.nn.TransformerModel`).
        cache: site names or globs to cache (``"*"``: every site).
        detach: cache detached tensors (False to backpropagate through them).
        device: where the cached tensors are kept; default where each site computed them (its
            layer's device, for a model placed over several: :mod:`attnlab.pretrained.placement`).
        replace: site name -> a module run in place of it (:meth:`Trace.replace_with`), whose
            sub-sites ``cache`` may name (``"decoder.1.resid_post.*"``).
        keep_error: the modules of ``replace`` add their error back.

    Yields:
        The :class:`Trace`.
    """
    if keep_error and not replace:
        raise UsageError("trace: keep_error=True applies to the modules of replace=, and none is given")
    traced = Trace(model, detach=detach, device=device)
    try:
        for site, module in (replace or {}).items():
            traced.replace_with(site, module, keep_error=keep_error)
        if cache is not None:
            traced.record(cache)
        yield traced
    finally:
        traced._remove()


def _as(value: Tensor | float, like: Tensor, site: str) -> Tensor:
    """``value`` on ``like``'s device and dtype, checked to broadcast to its shape."""
    if not isinstance(value, Tensor):
        return like.new_tensor(value)
    try:
        fits = torch.broadcast_shapes(value.shape, like.shape) == like.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(
            f"site {site!r}: a value of shape {tuple(value.shape)} does not broadcast to the site's {tuple(like.shape)}"
        )
    return value.to(device=like.device, dtype=like.dtype)


def _selector(site: Site, examples: Selection, heads: Selection, positions: Selection) -> dict[int, Selection]:
    """axis -> selection, checked against what the site has."""
    if heads is not None and site.head_axis is None:
        raise ValueError(
            f"site {site.name!r}: heads= needs a site with a head axis (attn.q_pre, .k_pre, .q, .k, .v, .scores, "
            ".pattern, .z, .result)"
        )
    if positions is not None and site.position_axis is None:
        raise ValueError(f"site {site.name!r}: has no positions axis; positions= does not apply")
    chosen = {0: examples, site.head_axis: heads, site.position_axis: positions}
    return {axis: selection for axis, selection in chosen.items() if axis is not None and selection is not None}


def _edit_on(selector: dict[int, Selection], function: Hook, name: str) -> Hook:
    """x -> function(x) where the selection's mask is True, x elsewhere."""

    def edit(x: Tensor) -> Tensor:
        edited = function(x)
        if edited.shape != x.shape:
            raise ValueError(
                f"site {name!r}: the edit gives shape {tuple(edited.shape)}, the site has {tuple(x.shape)}"
            )
        if not selector:
            return edited
        return torch.where(_mask(selector, x, name), edited, x)

    return edit


def _mask(selector: dict[int, Selection], x: Tensor, name: str) -> Tensor:
    """A bool tensor broadcastable to x: True on the outer product of the axes' selections."""
    mask = torch.ones((1,) * x.dim(), dtype=torch.bool, device=x.device)
    for axis, selection in selector.items():
        size = x.shape[axis]
        index = torch.as_tensor(selection, device=x.device).reshape(-1).to(torch.long)
        if index.numel() and (int(index.min()) < -size or int(index.max()) >= size):
            raise ValueError(f"site {name!r}: index {selection} is out of range for axis {axis} of size {size}")
        along = torch.zeros(size, dtype=torch.bool, device=x.device)
        along[index] = True
        shape = [1] * x.dim()
        shape[axis] = size
        mask = mask & along.view(shape)
    return mask


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


# ---- capture: every attention call's pattern and z ----------------------------------------------


@dataclass(frozen=True)
class AttentionRecord:
    """What one attention module computed in one call.

    Attributes:
        kind: ``encoder_self``, ``decoder_self``, ``cross`` or ``self``.
        layer: layer index within its kind.
        weights: (B, H, T_q, T_k) per-head attention weights (one-hot rows for hard attention):
            the module's ``pattern`` site.
        head_outputs: (B, H, T_q, d_v) per-head outputs, after the head mask, before W^O: its
            ``z`` site.
    """

    kind: str
    layer: int
    weights: Tensor
    head_outputs: Tensor


@contextmanager
def capture(model: nn.Module, *, detach: bool = True) -> Iterator[list[AttentionRecord]]:
    """Record every attention call of ``model`` inside the block: its ``*.attn.pattern`` and
    ``*.attn.z`` (``*.cross.*`` too), one :class:`AttentionRecord` per call, in call order.

        with capture(model) as records:
            model(src, tgt_in)

    While capturing, the weights are computed explicitly (the fused kernel does not expose them).

    Args:
        model: an attnlab model, or a lone :class:`~attnlab.nn.MultiHeadAttention` (kind ``self``,
            layer 0).
        detach: store detached tensors (set False to backpropagate through the records).

    Yields:
        The list that records are appended to.
    """
    sites = model_sites(model)
    records: list[AttentionRecord] = []
    removers = []
    for z in (site for site in sites.values() if site.point == "z"):
        pattern = sites[f"{z.prefix}.pattern"]
        seen: list[Tensor] = []

        def keep(weights: Tensor, seen: list[Tensor] = seen) -> Tensor:
            seen[:] = [weights.detach() if detach else weights]
            return weights

        def record(head_outputs: Tensor, seen: list[Tensor] = seen, site: Site = z) -> Tensor:
            kept = head_outputs.detach() if detach else head_outputs
            records.append(AttentionRecord(site.kind or "self", site.layer or 0, seen.pop(), kept))
            return head_outputs

        removers += [add_hook(pattern, keep), add_hook(z, record)]
    try:
        yield records
    finally:
        for remove in removers:
            remove()


# ---- the head mask xi: a scale of every z -------------------------------------------------------

HeadMask = Mapping[str, Tensor]
"""Attention kind -> xi, a float tensor of shape (layers, heads), or (B, layers, heads) for one
mask per example (Michel §2.3). Entry [l, h] multiplies the output of head h of layer l before W^O
(the site ``*.l.attn.z``, or ``cross``). Values are 0/1 for ablation, or real-valued with
``requires_grad`` so that dL/dxi_h gives head importance (Michel §3). A kind left out is not
masked. After physical pruning a layer with h heads reads the first h entries of its row."""

ATTENTION_KINDS = ("encoder_self", "decoder_self", "cross", "self")


def head_mask_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """kind -> (layers, heads) for every attention kind of the model (as wide as the widest layer
    of the kind, after physical pruning)."""
    return _shapes(attention_sites(model))


def _shapes(sites: Iterable[Site]) -> dict[str, tuple[int, int]]:
    shapes: dict[str, tuple[int, int]] = {}
    for site in sites:
        layers, heads = shapes.get(site.kind, (0, 0))  # type: ignore[arg-type]
        shapes[site.kind] = (max(layers, (site.layer or 0) + 1), max(heads, site.module.heads))  # type: ignore[index]
    return shapes


def check_head_mask(head_mask: HeadMask | None, shapes: Mapping[str, tuple[int, int]]) -> None:
    """Raise ``ValueError`` naming the kind when ``head_mask`` does not fit a model of ``shapes``."""
    if head_mask is None:
        return
    for kind, tensor in head_mask.items():
        if kind not in shapes:
            raise ValueError(f"head_mask: this model has no {kind!r} attention; it has: {', '.join(shapes)}")
        expected = shapes[kind]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise ValueError(f"head_mask[{kind!r}] must be a float tensor of shape {expected} or (B, *{expected})")
        if tuple(tensor.shape[-2:]) != expected or tensor.dim() not in (2, 3):
            raise ValueError(
                f"head_mask[{kind!r}] has shape {tuple(tensor.shape)}; expected (layers, heads) = {expected} "
                f"or (B, {expected[0]}, {expected[1]})"
            )


def full_head_mask(
    shapes: Mapping[str, tuple[int, int]],
    value: float = 1.0,
    *,
    batch: int | None = None,
    requires_grad: bool = False,
    device: torch.device | str | None = None,
) -> dict[str, Tensor]:
    """A head mask filled with ``value`` for every kind in ``shapes`` (all-ones keeps every head)."""
    lead = () if batch is None else (batch,)
    return {
        kind: torch.full((*lead, *shape), value, device=device, requires_grad=requires_grad)
        for kind, shape in shapes.items()
    }


@contextmanager
def masking_heads(model: nn.Module, head_mask: HeadMask | Tensor | None) -> Iterator[None]:
    """Run ``model`` inside the block with the head mask xi: z_h = xi_h head_h (Michel §2.3).

        with masking_heads(model, {"self": xi}):   # xi (layers, heads) or (B, layers, heads)
            logits = model(tokens)

    xi scales every masked module's ``z`` site before any other hook sees it, on the fused path
    (one multiplication per layer, no extra pass), and stays differentiable. None masks nothing.

    Args:
        model: an attnlab model, or a lone attention module with xi of shape (H,) or (B, H).
        head_mask: a :data:`HeadMask`, checked against the model (``ValueError`` naming the kind).
    """
    if head_mask is None:
        yield
        return
    if isinstance(head_mask, Tensor):  # a lone module: one layer of kind self
        if head_mask.dim() not in (1, 2):
            raise ValueError(f"head_mask must have shape (H,) or (B, H), got {tuple(head_mask.shape)}")
        head_mask = {"self": head_mask.unsqueeze(-2)}
    sites = attention_sites(model)
    check_head_mask(head_mask, _shapes(sites))
    removers = [
        add_hook(site, _head_scale(head_mask[site.kind], site.layer or 0, site.module.heads), first=True)
        for site in sites
        if site.kind in head_mask and site.module.heads
    ]
    try:
        yield
    finally:
        for remove in removers:
            remove()


def expert_mask_shape(model: nn.Module) -> tuple[int, int] | None:
    """(layers, experts) of a mixture-of-experts model's ``ffn.experts`` sites (a bridged model's,
    :mod:`attnlab.pretrained.bridge_sites`), or None for a model without them."""
    return _expert_shape([site for site in model_sites(model).values() if site.point == "experts"])


def _expert_shape(sites: list[Site]) -> tuple[int, int] | None:
    if not sites:
        return None
    return max(site.layer or 0 for site in sites) + 1, max(site.module.experts for site in sites)


@contextmanager
def masking_experts(model: nn.Module, mask: Tensor | None) -> Iterator[None]:
    """Run ``model`` inside the block with each expert's routing weight scaled: w_e -> m_{L,e} w_e
    at every ``ffn.experts`` site, the experts' counterpart of :func:`masking_heads` (m = 0 ablates
    expert e of layer L wherever the router chose it; differentiable in m).

        with masking_experts(model, mask):   # mask (layers, experts) or (B, layers, experts)
            logits = model(tokens)

    Raises:
        ValueError: a model without experts, or a mask of another shape (naming both).
    """
    if mask is None:
        yield
        return
    sites = [site for site in model_sites(model).values() if site.point == "experts"]
    shape = _expert_shape(sites)
    if shape is None:
        raise ValueError("expert mask: this model has no mixture-of-experts layers (no ffn.experts site)")
    if mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != shape:
        raise ValueError(
            f"expert mask: expected (layers, experts) = {shape} (or a batch of them), got {tuple(mask.shape)}"
        )
    removers = [add_hook(site, _expert_scale(mask, site.layer or 0), first=True) for site in sites]
    try:
        yield
    finally:
        for remove in removers:
            remove()


def _expert_scale(mask: Tensor, layer: int) -> Hook:
    """w (B, T, E) -> m[..., layer, :] w, per expert (and per example for a (B, layers, E) mask)."""

    def scale(weights: Tensor) -> Tensor:
        row = mask[..., layer, : weights.shape[-1]].to(weights.dtype)  # (E,) or (B, E)
        return weights * (row if row.dim() == 1 else row.unsqueeze(1))

    return scale


def _head_scale(xi: Tensor, layer: int, heads: int) -> Hook:
    """z -> xi[..., layer, :heads] * z, per head (and per example for a (B, layers, heads) xi).

    Shape:
        z: (B, H, T_q, d_v).
    """

    def scale(z: Tensor) -> Tensor:
        row = xi[..., layer, :heads]  # (H,) or (B, H)
        if row.dim() == 2 and row.shape[0] not in (1, z.shape[0]):
            raise ValueError(f"head_mask batch size {row.shape[0]} does not match the input's {z.shape[0]}")
        return z * row.to(z.dtype).reshape(-1, heads, 1, 1)  # xi_h head_h

    return scale
