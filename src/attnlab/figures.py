"""Drawing with matplotlib: a headless backend, PNG files written through a temporary file and a
rename, and the attention heatmaps every picture of attention is made of.

"Visualising learned attentions: different heads show different patterns" (Li's slides). Each
heatmap function returns the matplotlib Figure (for notebooks) and, given ``path``, also writes a
PNG. Queries run down the rows, keys along the columns, with the tokens as tick labels. Training
draws with them (TensorBoard's attention images, :mod:`attnlab.training.tensorboard_log`) as
analysis does (:mod:`attnlab.analysis.plots`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

from attnlab.run.storage import atomic_write

matplotlib.use("Agg")  # files only; never a window
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

__all__ = ["plt", "Figure", "save_figure", "head_heatmap", "layer_grid", "kind_grid"]


def save_figure(fig: Figure, path: Path, *, dpi: int = 110) -> Path:
    """Write ``fig`` as PNG atomically (a reader never sees half an image), then close it.

    Raises:
        UsageError: ``path`` cannot be written (see :func:`attnlab.run.storage.atomic_write`).
    """
    path = Path(path)
    try:
        atomic_write(path, lambda handle: fig.savefig(handle, format="png", dpi=dpi), "wb")
    finally:
        plt.close(fig)
    return path


_CMAP = "viridis"

# A map grows with its tokens up to these sizes, then its cells shrink and only every k-th token
# is labelled: a 160-token input had drawn 73-inch heatmaps and a 230-megapixel grid (4 GB, 3 min).
_MAX_MAP_INCHES = 16.0
_MAX_GRID_CELL_INCHES = 6.0
_MAX_KIND_GRID_INCHES = 24.0
"""The longer side of a :func:`kind_grid` (every layer and head of a kind): its cells shrink to fit."""
_MAX_TICK_LABELS = 64
_MAX_TICK_LABELS_SMALL = 64


def _inches(tokens: int, per_token: float, margin: float, smallest: float, largest: float) -> float:
    return min(largest, max(smallest, per_token * tokens + margin))


def head_heatmap(
    weights: np.ndarray,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    *,
    title: str = "",
    path: Path | None = None,
    argmax: bool = False,
) -> Figure:
    """One head's (T_q, T_k) weights; with ``argmax`` each row's maximum is outlined (hard attention)."""
    weights = np.asarray(weights, dtype=float)
    size = (
        _inches(len(key_tokens), 0.45, 1.5, 3.0, _MAX_MAP_INCHES),
        _inches(len(query_tokens), 0.45, 1.2, 2.5, _MAX_MAP_INCHES),
    )
    fig, ax = plt.subplots(figsize=size)
    image = ax.imshow(weights, cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
    _label_axes(ax, query_tokens, key_tokens)
    if argmax:
        for row, col in enumerate(weights.argmax(-1)):
            ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5))
    ax.set_title(title, fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def layer_grid(
    weights: np.ndarray,
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    *,
    title: str = "",
    path: Path | None = None,
    head_labels: Sequence[str] | None = None,
) -> Figure:
    """All H heads of one layer, (H, T_q, T_k), side by side: the "model view" of one layer."""
    weights = np.asarray(weights, dtype=float)
    heads = weights.shape[0]
    columns = min(heads, 4)
    rows = (heads + columns - 1) // columns
    cell = _inches(max(len(key_tokens), len(query_tokens)), 0.3, 1.0, 2.2, _MAX_GRID_CELL_INCHES)
    fig, axes = plt.subplots(rows, columns, figsize=(cell * columns, cell * rows), squeeze=False)
    for index, ax in enumerate(axes.flat):
        if index >= heads:
            ax.axis("off")
            continue
        ax.imshow(weights[index], cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
        _label_axes(ax, query_tokens, key_tokens, small=True)
        ax.set_title(head_labels[index] if head_labels else f"head {index}", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def kind_grid(
    maps: Sequence[np.ndarray],
    query_tokens: Sequence[str],
    key_tokens: Sequence[str],
    *,
    title: str = "",
    path: Path | None = None,
) -> Figure:
    """Every head of every layer of one attention kind: a grid with a row per layer, a column per head.

    Args:
        maps: one (H_l, T_q, T_k) array per layer, layer 0 first (:func:`attnlab.analysis.maps.kind_maps`);
            after physical pruning layers may keep fewer heads: their row has blank cells.
        query_tokens, key_tokens: the labels of the T_q rows and T_k columns.
    """
    layers, heads = len(maps), max(len(layer) for layer in maps)
    cell = _inches(max(len(key_tokens), len(query_tokens)), 0.3, 1.0, 2.2, _MAX_GRID_CELL_INCHES)
    cell = min(cell, _MAX_KIND_GRID_INCHES / max(layers, heads))
    fig, axes = plt.subplots(layers, heads, figsize=(cell * heads, cell * layers), squeeze=False)
    lowest = [max(layer for layer in range(layers) if head < len(maps[layer])) for head in range(heads)]
    for layer, row in enumerate(axes):
        for head, ax in enumerate(row):
            if head >= len(maps[layer]):
                ax.axis("off")
                continue
            ax.imshow(np.asarray(maps[layer][head], dtype=float), cmap=_CMAP, vmin=0.0, vmax=1.0, aspect="auto")
            ax.set_title(f"layer {layer}, head {head}", fontsize=8)
            # Every cell has the same tokens: only the left column's queries and the bottom cells' keys
            # are labelled (labelling every cell took most of the time of a 12 x 12 grid).
            if head == 0 or layer == lowest[head]:
                _label_axes(ax, query_tokens, key_tokens, small=True)
            if head > 0:
                ax.set_yticks([])
                ax.set_ylabel("")
            if layer < lowest[head]:
                ax.set_xticks([])
                ax.set_xlabel("")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def _label_axes(ax, query_tokens: Sequence[str], key_tokens: Sequence[str], *, small: bool = False) -> None:  # noqa: ANN001
    """Every token as a tick label, or every k-th one when there are more than fit."""
    size = 6 if small else 8
    most = _MAX_TICK_LABELS_SMALL if small else _MAX_TICK_LABELS
    key_ticks, query_ticks = _every_kth(len(key_tokens), most), _every_kth(len(query_tokens), most)
    ax.set_xticks(key_ticks)
    ax.set_xticklabels([key_tokens[i] for i in key_ticks], rotation=90, fontsize=size)
    ax.set_yticks(query_ticks)
    ax.set_yticklabels([query_tokens[i] for i in query_ticks], fontsize=size)
    ax.set_xlabel("key", fontsize=size)
    ax.set_ylabel("query", fontsize=size)


def _every_kth(count: int, most: int) -> list[int]:
    return list(range(0, count, -(-count // most) if count > most else 1))  # ceil(count / most)
