"""Naming heads (``kind:layer:head``) and building head masks from such names.

A head's name is its attention site's kind and layer (:mod:`attnlab.nn.hooks`: the ``kind`` of
the site ``STACK.LAYER.attn.z`` or ``STACK.LAYER.cross.z``) and its index on the site's head axis;
:meth:`HeadId.of` and :func:`head_site` go from a site to a head and back, and this module is the
one place that parses (:func:`parse_head_name`) and prints (``str(HeadId)``) the name.

Shared by training (heads held at zero while fine-tuning), evaluation from the command line,
head analysis and the viewer. A name that does not fit the model is a :class:`UsageError` that
says what the model has.

A run's *held* heads are those of ``train.mask_heads``: Michel §2.3's xi_h = 0, held through
training, so they never learned. :func:`held_mask` is the one place that turns them into a head
mask; every command that runs a trained model (eval, generate, attention, the viewer, heads
ablate/importance/prune, encode) starts from it, through
:meth:`attnlab.run.loaded.LoadedRun.held_mask`.

One vocabulary for one idea, a head mask with some heads at zero:

* *off*: a head a mask sets to 0. :func:`mask_without` builds a mask with given heads off (on top
  of a base mask); :func:`heads_off` reads which heads a mask has off.
* *held*: a head the run holds off since training. :func:`held_heads` parses the specs,
  :func:`held_mask` is their mask; ``LoadedRun.held_heads`` / ``held_mask`` give a run's, and
  ``analysis.heads.held_heads_of`` / ``held_mask_of`` a probe's.
* *live*: a head not held (``analysis.heads.live_heads``): what analysis may switch off.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import astuple, dataclass

import torch
from torch import Tensor

from attnlab.errors import ConfigError, UsageError
from attnlab.nn import HeadMask, Site, TransformerModel

__all__ = [
    "HeadId",
    "KIND_TITLES",
    "head_ids",
    "head_site",
    "parse_head_name",
    "parse_head",
    "mask_without",
    "heads_off",
    "held_heads",
    "held_mask",
]


KIND_TITLES = {
    "encoder_self": "encoder self-attention",
    "decoder_self": "decoder masked self-attention",
    "cross": "encoder-decoder attention",
    "self": "self-attention",
}
"""A person's name for each attention kind, a head's ``kind`` (Vaswani §3.2.3: the three uses of
attention), for titles of pictures and views."""


@dataclass(frozen=True, order=True)
class HeadId:
    """One attention head: its site's kind and layer, and its index on the site's head axis."""

    kind: str
    layer: int
    head: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.layer}:{self.head}"

    @classmethod
    def of(cls, site: Site, head: int) -> HeadId:
        """Head ``head`` of an attention site (any of its points: ``z``, ``pattern``, ...)."""
        if site.kind is None or site.layer is None:
            raise ValueError(f"site {site.name!r} is not an attention site; it has no heads")
        return cls(site.kind, site.layer, head)


def head_site(model: TransformerModel, head: HeadId) -> Site:
    """The ``z`` site of the attention module ``head`` belongs to (e.g. ``decoder.3.attn.z``)."""
    for site in model.attention_sites():
        if (site.kind, site.layer) == (head.kind, head.layer):
            return site
    raise UsageError(f"head {head}: this model has no {head.kind} attention in layer {head.layer}")


_MOST_DIGITS = 19
"""Digits of the largest layer or head index read (2**63 - 1): a longer number names no head and is
refused before Python converts it (past 4,300 digits it would raise)."""


def parse_head_name(spec: str) -> HeadId:
    """``kind:layer:head`` -> :class:`HeadId`, the syntax only (UsageError otherwise)."""
    parts = spec.split(":")
    if len(parts) != 3 or not parts[1].lstrip("-").isdigit() or not parts[2].lstrip("-").isdigit():
        raise UsageError(f"head {spec!r}: expected kind:layer:head, e.g. cross:0:1")
    if max(len(parts[1]), len(parts[2])) > _MOST_DIGITS:  # no model has such a layer or head
        raise UsageError(f"head {spec!r}: a layer or head number of more than {_MOST_DIGITS} digits")
    return HeadId(parts[0], int(parts[1]), int(parts[2]))


def head_ids(model: TransformerModel, kinds: Sequence[str] | None = None) -> list[HeadId]:
    """Every head of the model (of ``kinds`` only, when given), in (kind, layer, head) order, the
    kinds in the order a forward pass first reaches them."""
    sites = model.attention_sites()
    rank = {kind: index for index, kind in enumerate(dict.fromkeys(site.kind for site in sites))}
    for kind in kinds or ():
        if kind not in rank:
            raise UsageError(f"this run has no {kind!r} attention; it has: {', '.join(sorted(rank))}")
    return [
        HeadId.of(site, head)
        for site in sorted(sites, key=lambda site: (rank[site.kind], site.layer))
        if kinds is None or site.kind in kinds
        for head in range(site.module.heads)
    ]


def parse_head(spec: str, model: TransformerModel) -> HeadId:
    """``kind:layer:head`` -> :class:`HeadId`, checked against the model (UsageError otherwise)."""
    kind, layer, head = astuple(parse_head_name(spec))
    sites = {(s.kind, s.layer): s.module.heads for s in model.attention_sites()}
    kinds = sorted({k for k, _ in sites})
    if kind not in kinds:
        raise UsageError(f"head {spec!r}: this run has no {kind!r} attention; it has: {', '.join(kinds)}")
    layers = sorted(layer_index for k, layer_index in sites if k == kind)
    if (kind, layer) not in sites:
        raise UsageError(f"head {spec!r}: layer {layer} is out of range; {kind} has layers 0..{layers[-1]}")
    if not 0 <= head < sites[(kind, layer)]:
        raise UsageError(
            f"head {spec!r}: head {head} is out of range; {kind} layer {layer} has heads 0..{sites[(kind, layer)] - 1}"
        )
    return HeadId(kind, layer, head)


def mask_without(model: TransformerModel, off: Iterable[HeadId], *, base: HeadMask | None = None) -> dict[str, Tensor]:
    """A head mask that keeps every head (or ``base``) except those in ``off``, which are 0.

    ``base`` may hold (layers, heads) or per-example (B, layers, heads) tensors; a head in ``off``
    is 0 in every row.
    """
    device = next(model.parameters()).device
    mask = {kind: torch.ones(shape, device=device) for kind, shape in model.head_mask_shapes().items()}
    for kind, tensor in (base or {}).items():
        mask[kind] = tensor.detach().clone().to(device)
    for head in off:
        mask[head.kind][..., head.layer, head.head] = 0.0
    return mask


def heads_off(model: TransformerModel, mask: HeadMask | None) -> list[HeadId]:
    """The heads whose entry of ``mask`` is 0 (in every row of a per-example mask), in :func:`head_ids` order."""
    if not mask:
        return []
    zero = {
        kind: (tensor == 0) if tensor.dim() == 2 else (tensor == 0).flatten(0, -3).all(0)
        for kind, tensor in mask.items()
    }
    return [h for h in head_ids(model) if h.kind in zero and bool(zero[h.kind][h.layer, h.head])]


def held_heads(model: TransformerModel, specs: Sequence[str]) -> list[HeadId]:
    """The heads named by a run's ``train.mask_heads`` (``kind:layer:head``), checked against ``model``.

    Raises:
        ConfigError: a name that does not fit the model, prefixed ``train.mask_heads``.
    """
    held = []
    for spec in specs:
        try:
            held.append(parse_head(spec, model))
        except UsageError as error:
            raise ConfigError(f"train.mask_heads: {error}") from None
    return list(dict.fromkeys(held))


def held_mask(
    model: TransformerModel, specs: Sequence[str], off: Iterable[HeadId] = (), *, base: HeadMask | None = None
) -> dict[str, Tensor] | None:
    """The head mask a run's model is used with: its held heads (``specs``, i.e. ``train.mask_heads``,
    Michel §2.3's xi_h = 0) and the heads in ``off`` at 0, on top of ``base`` (default all ones).

    None when nothing is masked (no held head, nothing ``off``, no ``base``), so that a run
    without held heads takes the unmasked fast path exactly as before.
    """
    masked = [*held_heads(model, specs), *off]
    if not masked:
        return None if base is None else dict(base)
    return mask_without(model, masked, base=base)
