"""Capture every attention layer's weights and per-head outputs, without touching internals.

    with capture(model) as records:
        model(src, tgt_in)
    for r in records:
        r.kind, r.layer, r.weights.shape, r.head_outputs.shape

One :class:`AttentionRecord` is appended per attention-module call, in call order. While capturing,
attention weights are computed explicitly (the fused kernel does not expose them); outside a
capture block the fused path runs. Analysis and the viewer read these records; they never reach
into a layer's attributes (Li's slides, "Visualising learned attentions").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from torch import Tensor

from attnlab.nn.multi_head import MultiHeadAttention

__all__ = ["AttentionRecord", "capture"]


@dataclass(frozen=True)
class AttentionRecord:
    """What one attention module computed in one call.

    Attributes:
        kind: ``encoder_self``, ``decoder_self``, ``cross`` or ``self``.
        layer: layer index within its kind.
        weights: (B, H, T_q, T_k) per-head attention weights (one-hot rows for hard attention).
        head_outputs: (B, H, T_q, d_v) per-head outputs, after the head mask, before W^O.
    """

    kind: str
    layer: int
    weights: Tensor
    head_outputs: Tensor


@contextmanager
def capture(model: object, *, detach: bool = True) -> Iterator[list[AttentionRecord]]:
    """Record every attention call of ``model`` inside the block.

    Args:
        model: a model with ``attention_sites()`` (every attnlab model), or a single
            :class:`MultiHeadAttention` (recorded as kind ``self``, layer 0).
        detach: store detached tensors (set False to backpropagate through the records).

    Yields:
        The list that records are appended to.
    """
    if isinstance(model, MultiHeadAttention):
        sites = [("self", 0, model)]
    elif hasattr(model, "attention_sites"):
        sites = [(site.kind, site.layer, site.module) for site in model.attention_sites()]
    else:
        raise TypeError(f"capture: {type(model).__name__} has no attention_sites() and is not a MultiHeadAttention")
    records: list[AttentionRecord] = []
    removers = [module.add_recorder(_recorder(records, kind, layer, detach)) for kind, layer, module in sites]
    try:
        yield records
    finally:
        for remove in removers:
            remove()


def _recorder(records: list[AttentionRecord], kind: str, layer: int, detach: bool):  # noqa: ANN202
    def record(weights: Tensor, head_outputs: Tensor) -> None:
        if detach:
            weights, head_outputs = weights.detach(), head_outputs.detach()
        records.append(AttentionRecord(kind, layer, weights, head_outputs))

    return record
