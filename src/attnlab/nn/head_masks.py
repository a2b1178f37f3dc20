"""The head mask xi and the expert mask: scales of named sites, differentiable in the mask.

Michel et al. (2019, §2.3): head h of layer l outputs z_h = xi_h head_h before W^O, a hook that
scales the site ``*.l.attn.z`` (``cross`` for encoder-decoder attention) ahead of any other hook;
xi_h = 0 ablates the head and dL/dxi_h is its importance (§3). :func:`masking_experts` is the same
for a mixture of experts: w_e -> m_{L,e} w_e at every ``ffn.experts`` site.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from attnlab.errors import ModelRequestError
from attnlab.nn.hooks import Hook, Site, add_hook, attention_sites, model_sites

__all__ = [
    "HeadMask",
    "ATTENTION_KINDS",
    "head_mask_shapes",
    "check_head_mask",
    "full_head_mask",
    "masking_heads",
    "expert_mask_shape",
    "masking_experts",
]

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
            raise ModelRequestError(f"head_mask: this model has no {kind!r} attention; it has: {', '.join(shapes)}")
        expected = shapes[kind]
        if not isinstance(tensor, Tensor) or not tensor.is_floating_point():
            raise ModelRequestError(
                f"head_mask[{kind!r}] must be a float tensor of shape {expected} or (B, *{expected})"
            )
        if tuple(tensor.shape[-2:]) != expected or tensor.dim() not in (2, 3):
            raise ModelRequestError(
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
            raise ModelRequestError(f"head_mask must have shape (H,) or (B, H), got {tuple(head_mask.shape)}")
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
        raise ModelRequestError("expert mask: this model has no mixture-of-experts layers (no ffn.experts site)")
    if mask.dim() not in (2, 3) or tuple(mask.shape[-2:]) != shape:
        raise ModelRequestError(
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
            raise ModelRequestError(f"head_mask batch size {row.shape[0]} does not match the input's {z.shape[0]}")
        return z * row.to(z.dtype).reshape(-1, heads, 1, 1)  # xi_h head_h

    return scale
