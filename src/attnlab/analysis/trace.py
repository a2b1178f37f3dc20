"""Read and edit any named site of a model: caching, ablation and activation patching.

    from attnlab import trace

    with trace(model, cache=["encoder.*.resid_post", "encoder.2.attn.pattern"]) as clean:
        model(clean_tokens)
    with trace(model) as t:
        t.replace("encoder.2.attn.z", clean.cache["encoder.2.attn.z"], heads=[5])  # patch one head
        t.scale("encoder.0.ffn.out", 0.0, positions=[3])                          # zero one position
        patched = model(corrupt_tokens)

The sites and their shapes are the vocabulary of :mod:`attnlab.nn.sites` (``attnlab sites RUN``
lists a run's). An edit applies to a slice of its site chosen by ``examples`` (axis 0), ``heads``
(axis 1 of a head site) and ``positions`` (the query positions' axis); elsewhere the tensor passes
unchanged. Edits of one site apply in the order given, and compose with the head mask: ``z`` and
``result`` are read after xi_h multiplies each head. The cache holds, for every requested site, the
value the model went on with (after this trace's edits) in its latest forward pass inside the block.

Activation patching (Vig et al. 2020; Meng et al. 2022) replaces a site's value on a "corrupt"
input with its value on a "clean" one and measures how much of the clean output returns; mean
ablation replaces it with its mean over a dataset; zero ablation of ``result`` for head h is
Michel et al.'s xi_h = 0.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attnlab.nn.sites import Site, model_sites

__all__ = ["Trace", "trace", "resolve_sites"]

Selection = int | Sequence[int] | Tensor | None
"""Indices along one axis (an int, a list or a 1-D tensor), or None for all of it."""


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


@dataclass
class _Handler:
    """What one trace does at one site: its edits in order, then recording."""

    site: Site
    edits: list[Callable[[Tensor], Tensor]] = field(default_factory=list)
    record: bool = False

    def __call__(self, x: Tensor, cache: dict[str, Tensor], detach: bool) -> Tensor:
        for edit in self.edits:
            x = edit(x)
        if self.record:
            cache[self.site.name] = x.detach() if detach else x
        return x


class Trace:
    """The sites of one traced model, what is cached from them, and the edits on them.

    Attributes:
        sites: every site of the model, by name (:func:`attnlab.nn.sites.model_sites`).
        cache: site name -> its tensor in the latest forward pass, for the requested sites.
    """

    def __init__(self, model: nn.Module, *, detach: bool = True) -> None:
        self.model = model
        self.sites = model_sites(model)
        self.cache: dict[str, Tensor] = {}
        self._detach = detach
        self._handlers: dict[str, _Handler] = {}
        self._installed: list[tuple[dict, str, object]] = []  # (taps, point, what was there before)

    # ---- what to read -----------------------------------------------------------------------

    def record(self, patterns: str | Iterable[str]) -> list[str]:
        """Cache the sites matching ``patterns`` from now on; returns their names."""
        names = resolve_sites(self.sites, [patterns] if isinstance(patterns, str) else patterns)
        for name in names:
            self._handler(name).record = True
        return names

    # ---- how to edit --------------------------------------------------------------------------

    def edit(
        self,
        site: str,
        function: Callable[[Tensor], Tensor],
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

    # ---- installing -------------------------------------------------------------------------

    def _handler(self, name: str) -> _Handler:
        if name not in self._handlers:
            handler = self._handlers[name] = _Handler(self.sites[name])
            site = self.sites[name]
            taps = site.module.taps
            before = taps.get(site.point)
            cache, detach = self.cache, self._detach

            def run(x: Tensor, handler: _Handler = handler, before: object = before) -> Tensor:
                if before is not None:  # an enclosing trace's function first
                    x = before(x)  # type: ignore[operator]
                return handler(x, cache, detach)

            taps[site.point] = run
            self._installed.append((taps, site.point, before))
        return self._handlers[name]

    def _remove(self) -> None:
        for taps, point, before in reversed(self._installed):
            if before is None:
                taps.pop(point, None)
            else:
                taps[point] = before
        self._installed.clear()


@contextmanager
def trace(model: nn.Module, cache: str | Iterable[str] | None = None, *, detach: bool = True) -> Iterator[Trace]:
    """Trace ``model`` inside the block: cache the sites matching ``cache`` and apply the edits given
    to the yielded :class:`Trace`; on leaving, the model is as it was.

    Args:
        model: an attnlab model (:class:`attnlab.nn.TransformerModel`).
        cache: site names or globs to cache (``"*"``: every site).
        detach: cache detached tensors (False to backpropagate through them).

    Yields:
        The :class:`Trace`.
    """
    traced = Trace(model, detach=detach)
    try:
        if cache is not None:
            traced.record(cache)
        yield traced
    finally:
        traced._remove()


# ---- selections ---------------------------------------------------------------------------------


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
            f"site {site.name!r}: heads= needs a site with a head axis (attn.q, .k, .v, .scores, .pattern, .z, .result)"
        )
    if positions is not None and site.position_axis is None:
        raise ValueError(f"site {site.name!r}: has no positions axis; positions= does not apply")
    chosen = {0: examples, site.head_axis: heads, site.position_axis: positions}
    return {axis: selection for axis, selection in chosen.items() if axis is not None and selection is not None}


def _edit_on(
    selector: dict[int, Selection], function: Callable[[Tensor], Tensor], name: str
) -> Callable[[Tensor], Tensor]:
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
