"""Tracing: cache the named sites of a forward pass and edit them on a slice.

A :class:`Trace` is hooks on the sites of :mod:`attnlab.nn.hooks`: at each site it runs its edits
in order (replace, add, scale, any function, on the slice chosen by examples, heads and positions:
x -> where(selection, f(x), x)), then keeps the value the model goes on with, then any module run
in place of the site (an SAE, a transcoder: :mod:`attnlab.nn.replacement`). Activation patching
(Vig et al. 2020; Meng et al. 2022), mean and zero ablation are edits.

Attention weights and head outputs are sites like any other: ``trace(model, ["*.pattern", "*.z"])``
caches every attention module's ``pattern`` (B, H, T_q, T_k) and ``z`` (B, H, T_q, d_v), self- and
cross-attention, by name (``decoder.0.cross.pattern``), in the order the forward pass reaches them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnlab.errors import ModelRequestError, UsageError
from attnlab.nn.hooks import Hook, Site, add_hook, model_sites, resolve_sites
from attnlab.nn.replacement import Replacement

__all__ = [
    "Selection",
    "Trace",
    "trace",
]


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
        raise ModelRequestError(
            f"site {site!r}: a value of shape {tuple(value.shape)} does not broadcast to the site's {tuple(like.shape)}"
        )
    return value.to(device=like.device, dtype=like.dtype)


def _selector(site: Site, examples: Selection, heads: Selection, positions: Selection) -> dict[int, Selection]:
    """axis -> selection, checked against what the site has."""
    if heads is not None and site.head_axis is None:
        raise ModelRequestError(
            f"site {site.name!r}: heads= needs a site with a head axis (attn.q_pre, .k_pre, .q, .k, .v, .scores, "
            ".pattern, .z, .result)"
        )
    if positions is not None and site.position_axis is None:
        raise ModelRequestError(f"site {site.name!r}: has no positions axis; positions= does not apply")
    chosen = {0: examples, site.head_axis: heads, site.position_axis: positions}
    return {axis: selection for axis, selection in chosen.items() if axis is not None and selection is not None}


def _edit_on(selector: dict[int, Selection], function: Hook, name: str) -> Hook:
    """x -> function(x) where the selection's mask is True, x elsewhere."""

    def edit(x: Tensor) -> Tensor:
        edited = function(x)
        if edited.shape != x.shape:
            raise ModelRequestError(
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
            raise ModelRequestError(f"site {name!r}: index {selection} is out of range for axis {axis} of size {size}")
        along = torch.zeros(size, dtype=torch.bool, device=x.device)
        along[index] = True
        shape = [1] * x.dim()
        shape[axis] = size
        mask = mask & along.view(shape)
    return mask
