"""The whole model at a glance: every head's attention map pooled to a small thumbnail.

The model view pages a model of many heads by layer (SmolLM2: 30 layers x 9 heads, one layer a
page). Above the pages the viewer draws an overview of every head, a layers x heads grid of
thumbnails, so that a head worth a closer look can be found in one glance and opened with a click.

A thumbnail is the map pooled to at most :data:`THUMBNAIL` x :data:`THUMBNAIL` blocks: the queries
are split into ``m = min(T_q, THUMBNAIL)`` contiguous blocks ``Q_i`` and the keys into
``n = min(T_k, THUMBNAIL)`` blocks ``K_j`` (block ``i`` of ``T`` positions split ``m`` ways is
``[floor(i T / m), floor((i + 1) T / m))``), and

    A'[i, j] = (1 / |Q_i|) * sum_{q in Q_i} sum_{k in K_j} A[q, k],

the attention a query of block ``i`` pays, on average, to the keys of block ``j``. Each row of
``A'`` sums to 1 as a row of ``A`` does, so a thumbnail reads as a small attention map on the
heatmap's own 0-to-1 scale: a previous-token head stays a diagonal, a head resting on the first
token a dark first column, whatever the input's length (a mean over keys would fade every map of
a long input towards 1/T). A map of at most :data:`THUMBNAIL` positions a side is its own thumbnail.

The thumbnails travel quantised to bytes (``round(255 * A')``), base64-encoded, row-major: at most
``4 * ceil(THUMBNAIL**2 / 3)`` = 344 characters a head whatever the input's length (a full map of
a 300-token input is 90,000 weights). SmolLM2's 270 heads make about 95 KB of JSON.
"""

from __future__ import annotations

import base64
from collections.abc import Collection
from typing import Any

import numpy as np

from attnlab.analysis.maps import AttentionView, kind_maps
from attnlab.head_ids import HeadId

__all__ = ["THUMBNAIL", "pool_map", "thumbnail_bytes", "overview_json"]

THUMBNAIL = 16
"""Most blocks a thumbnail has a side: 256 bytes a head."""


def pool_map(weights: np.ndarray, size: int = THUMBNAIL) -> np.ndarray:
    """Pool attention maps to at most ``size`` x ``size`` blocks (see the module's formula).

    Args:
        weights: the maps, rows of queries, columns of keys.
        size: the most blocks a side.

    Shape:
        weights: (H, T_q, T_k) -> (H, min(T_q, size), min(T_k, size)).

    Returns:
        Per block, the mean over its queries of the summed weight on its keys (float64).
    """
    weights = np.asarray(weights, dtype=np.float64)
    t_q, t_k = weights.shape[-2:]
    rows, columns = _block_starts(t_q, size), _block_starts(t_k, size)
    summed = np.add.reduceat(np.add.reduceat(weights, rows, axis=-2), columns, axis=-1)
    counts = np.diff(np.append(rows, t_q))
    return summed / counts[:, None]


def _block_starts(length: int, size: int) -> np.ndarray:
    """The first position of each of ``min(length, size)`` contiguous, non-empty blocks of ``length``."""
    blocks = min(length, size)
    return (np.arange(blocks) * length) // blocks


def thumbnail_bytes(pooled: np.ndarray) -> str:
    """One pooled map (rows, columns), clipped to [0, 1], as base64 of ``round(255 * weight)`` bytes, row-major."""
    quantised = np.rint(np.clip(pooled, 0.0, 1.0) * 255).astype(np.uint8)
    return base64.b64encode(quantised.tobytes()).decode("ascii")


def overview_json(view: AttentionView, off: Collection[HeadId]) -> dict[str, Any]:
    """``POST /api/run``'s ``overview``: a thumbnail of every head of every kind and layer of ``view``.

    Args:
        view: one forward pass's maps (every layer is captured, whatever page is shown).
        off: the heads switched off in that pass (the run's held heads included).

    Returns:
        ``{"size": THUMBNAIL, "maps": [{"kind", "layer", "rows", "columns", "heads": [base64, ...],
        "off": [head, ...]}, ...]}``, kinds in the view's order, layers from 0; ``heads`` has one
        thumbnail per head of that layer (pruned layers have fewer), ``off`` the indices of its
        heads switched off.
    """
    maps = []
    for kind in view.axes:
        for layer, weights in enumerate(kind_maps(view, kind)):
            pooled = pool_map(weights)
            maps.append(
                {
                    "kind": kind,
                    "layer": layer,
                    "rows": pooled.shape[1],
                    "columns": pooled.shape[2],
                    "heads": [thumbnail_bytes(head) for head in pooled],
                    "off": sorted(h.head for h in off if (h.kind, h.layer) == (kind, layer)),
                }
            )
    return {"size": THUMBNAIL, "maps": maps}
