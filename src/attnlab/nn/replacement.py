"""A site replaced by a module: sparse autoencoders and transcoders inside the model.

A traced site's value y can run through any ``nn.Module`` in place of itself, y -> module(y)
(:meth:`attnlab.nn.trace.Trace.replace_with`, ``trace(model, replace={site: module})``). A module
with ``encode`` and ``decode`` methods (the convention of SAELens' SAEs and of transcoders) is a
learned dictionary: its features and what it makes of them become sites of their own.

A sparse autoencoder (Bricken et al. 2023, "Towards Monosemanticity", §"Sparse Autoencoder"):

    f = ReLU(W_enc (x - b_dec) + b_enc)        the features, (..., F) with F >> d
    x_hat = W_dec f + b_dec                    the reconstruction of x from them
    e = x - x_hat                              what the dictionary misses (the error)

trained on cached activations to minimise ||x - x_hat||^2 + lambda ||f||_1. A transcoder
(Dunefsky, Chlenski & Nanda 2024, "Transcoders Find Interpretable LLM Feature Circuits") has the
same form but reads the MLP's input and approximates its output, y_hat = W_dec f + b_dec ~ MLP(x):
it replaces the site ``ffn.out`` and reads another site (``reads=``), the error is then
e = y - y_hat with y the site's own value.

The sub-sites of a replaced site ``SITE``, cached and edited as any other site (the same shapes
but for the last axis of ``features``; the site's head and position axes), x the module's input
(y, or the site it ``reads``):

    SITE.features        f = encode(x)                   (encode/decode modules only)
    SITE.reconstruction  decode(f), or module(x)         what the model goes on with
    SITE.error           y - decode(encode(x))           from the unedited features

With ``keep_error`` the model goes on with reconstruction + error instead (SAELens'
``use_error_term``): equal to the site's value, up to rounding, until an edit of the features or
the reconstruction changes it, by exactly that edit's effect through ``decode``. The error comes
from the unedited features, so that zeroing a feature removes its term of the decoder, f_j W_dec[j];
where a gradient flows it is a node of its own (Marks et al. 2024, "Sparse Feature Circuits",
App. A.3): the output's derivative in the features is decode's, in the site's value the identity.

The module reads the site's value after the site's own edits (``SITE`` itself is cached as the
site computed it: the dictionary's input), in the module's dtype and on its device where it has
parameters; what it gives back is cast to the site's.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from dataclasses import replace as with_fields
from typing import Any, Protocol, TypeVar

import torch
from torch import Tensor, nn

from attnlab.errors import UsageError

__all__ = ["Replacement", "is_dictionary"]

CODED_POINTS = ("features", "reconstruction", "error")
"""The sub-sites of a site replaced by a module with ``encode`` and ``decode``, in order."""

PLAIN_POINTS = ("reconstruction", "error")
"""The sub-sites of a site replaced by any other module."""


class _Named(Protocol):
    """A site as :func:`attnlab.nn.hooks.model_sites` makes it (only the fields read here)."""

    name: str
    point: str


S = TypeVar("S", bound=_Named)


def is_dictionary(module: nn.Module) -> bool:
    """Whether ``module`` has callable ``encode`` and ``decode`` (an SAE's or a transcoder's)."""
    return callable(getattr(module, "encode", None)) and callable(getattr(module, "decode", None))


class Replacement(nn.Module):
    """A module run in place of one site, with its own sites: ``features``, ``reconstruction``,
    ``error`` (see the module docstring).

    Called on the site's value y it returns decode(f) (or module(x)), + e with ``keep_error``,
    where x is y or, with ``reads``, the latest value of that other site.

    Args:
        module: the module to run (an SAE, a transcoder, any ``nn.Module``).
        site: the name of the site it replaces (for the messages).
        keep_error: add the error back (the model's output is unchanged until an edit).
        reads: the site whose value the module reads, computed earlier in the same forward pass
            (a transcoder's MLP input); None: the replaced site itself.

    Attributes:
        hooks: point -> hooks, as every module that owns sites (:mod:`attnlab.nn.hooks`).
        site_points: the sub-sites' points, in the order they are computed.

    Shape:
        y: (..., d) -> (..., d); features (..., F).

    Raises:
        UsageError: a module that is not an ``nn.Module``, a site that is not a tensor, or a
            module that cannot read the site or gives back another shape (naming the site).
    """

    def __init__(self, module: nn.Module, site: str, *, keep_error: bool = False, reads: str | None = None) -> None:
        if not isinstance(module, nn.Module):
            raise UsageError(f"replace {site!r}: a torch.nn.Module is needed, got {type(module).__name__}")
        super().__init__()
        self.module = module
        self.site = site
        self.keep_error = keep_error
        self.reads = reads
        self.coded = is_dictionary(module)
        self.site_points = CODED_POINTS if self.coded else PLAIN_POINTS
        self.hooks: dict[str, list[Callable[[Tensor], Tensor]]] = {}
        self._read: Tensor | None = None

    def read(self, x: Tensor) -> Tensor:
        """Keep ``x``, the value of the site the module reads, for the replaced site; a hook that
        returns ``x`` unchanged."""
        self._read = x
        return x

    def forward(self, y: Tensor) -> Tensor:
        """The value the model goes on with in place of ``y``, the replaced site's."""
        y = self._tensor(y, "the site's value")
        x = y if self.reads is None else self._take_read()
        source = self._as_input(x)
        unedited = None
        if self.coded:
            features = self._call(self.module.encode, source, "encode")
            used = self._run("features", features)
            made = self._output(self._call(self.module.decode, used, "decode"), y, "decode")
            unedited = None if used is features else features  # the features an edit changed
        else:
            made = self._output(self._call(self.module, source, "the module"), y, "the module")
        reconstruction = self._run("reconstruction", made)
        if not (self.keep_error or "error" in self.hooks):
            return reconstruction
        error = self._run("error", y - self._clean(source, made, unedited))
        return reconstruction + error if self.keep_error else reconstruction

    def _clean(self, source: Tensor, made: Tensor, unedited: Tensor | None) -> Tensor:
        """decode(encode(x)) from the unedited features (``unedited``, or those ``made`` came from).

        Where a gradient flows it is computed again, in a graph of its own: the error is then a node
        of its own (Marks et al. 2024, "Sparse Feature Circuits", App. A.3), the derivative of the
        output in the features is decode's alone and in x, through features and error, the identity.
        """
        if torch.is_grad_enabled() and made.requires_grad:
            again = self.module.decode(self.module.encode(source)) if self.coded else self.module(source)
            return again.to(device=made.device, dtype=made.dtype)
        if unedited is not None:
            return self.module.decode(unedited).to(device=made.device, dtype=made.dtype)
        return made

    def _run(self, point: str, x: Tensor) -> Tensor:
        for hook in self.hooks.get(point, ()):
            x = hook(x)
        return x

    def _take_read(self) -> Tensor:
        x, self._read = self._read, None
        if x is None:
            raise UsageError(
                f"replace {self.site!r}: reads {self.reads!r}, which this forward pass did not compute before it"
            )
        return x

    def _as_input(self, x: Tensor) -> Tensor:
        parameter = next(self.module.parameters(), None)
        if parameter is None or not parameter.is_floating_point():
            return x
        return x.to(device=parameter.device, dtype=parameter.dtype)

    def _call(self, function: Callable[[Tensor], Any], x: Tensor, what: str) -> Tensor:
        try:
            out = function(x)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as error:  # a width that does not fit: name the site, keep torch's words
            raise UsageError(
                f"replace {self.site!r}: {what} of {type(self.module).__name__} fails on a tensor of shape "
                f"{tuple(x.shape)}: {error}"
            ) from error
        return self._tensor(out, f"{what}'s output")

    def _tensor(self, x: object, what: str) -> Tensor:
        if not isinstance(x, Tensor):
            raise UsageError(f"replace {self.site!r}: {what} is a {type(x).__name__}, not a tensor")
        return x

    def _output(self, made: Tensor, y: Tensor, what: str) -> Tensor:
        if made.shape != y.shape:
            raise UsageError(
                f"replace {self.site!r}: {what} of {type(self.module).__name__} gives shape {tuple(made.shape)}, "
                f"the site has {tuple(y.shape)}"
            )
        return made.to(device=y.device, dtype=y.dtype)

    def splice(self, sites: Mapping[str, S]) -> dict[str, S]:
        """``sites`` with this replacement's sub-sites after the site it replaces, as copies of that
        site (its stack, layer, head and position axes) whose hooks are this module's.

        Raises:
            UsageError: a site name that is a pattern or not in ``sites``, a site already replaced,
                or ``reads`` not a site computed before it.
        """
        _check_name(sites, self.site, "replace")
        if f"{self.site}.reconstruction" in sites:
            raise UsageError(f"replace {self.site!r}: the site is already replaced in this trace")
        if self.reads is not None:
            _check_name(sites, self.reads, f"replace {self.site!r}: reads")
            order = list(sites)
            if order.index(self.reads) >= order.index(self.site):
                raise UsageError(
                    f"replace {self.site!r}: reads {self.reads!r}, which a forward pass computes after it "
                    "(a module reads a site computed earlier)"
                )
        spliced: dict[str, S] = {}
        for name, site in sites.items():
            spliced[name] = site
            if name == self.site:
                for point in self.site_points:
                    spliced[f"{name}.{point}"] = with_fields(site, name=f"{name}.{point}", module=self, point=point)
        return spliced


def _check_name(sites: Mapping[str, Any], name: str, what: str) -> None:
    """UsageError unless ``name`` is one site of ``sites`` (no pattern), naming the closest."""
    if any(c in name for c in "*?["):
        raise UsageError(f"{what} {name!r}: one site name is needed, not a pattern")
    if name not in sites:
        close = difflib.get_close_matches(name, list(sites), n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(close)}?" if close else f"; e.g. {', '.join(list(sites)[:3])}"
        raise UsageError(f"{what} {name!r}: no such site in this model{hint}")
