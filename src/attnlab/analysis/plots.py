"""Attention heatmaps with matplotlib: one head, or a grid of every head of a layer.

"Visualising learned attentions: different heads show different patterns" (Li's slides). Each
function returns the matplotlib Figure (for notebooks) and, given ``path``, also writes a PNG.
Queries run down the rows, keys along the columns, with the tokens as tick labels.

:func:`attention_figures` draws every map of an :class:`~attnlab.analysis.maps.AttentionView`
(each head of each layer of each kind, one grid per layer, and for hard attention the argmax
pattern); :func:`save_attention_pictures` writes them all, as ``attnlab attention`` does.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from attnlab.analysis.maps import KIND_TITLES, AttentionView, kind_maps
from attnlab.figures import Figure, plt, save_figure
from attnlab.head_ids import HeadId

__all__ = [
    "head_heatmap",
    "layer_grid",
    "argmax_pattern",
    "attention_figures",
    "save_attention_pictures",
    "save_figure",
]

_CMAP = "viridis"

# A map grows with its tokens up to these sizes, then its cells shrink and only every k-th token
# is labelled: a 160-token input had drawn 73-inch heatmaps and a 230-megapixel grid (4 GB, 3 min).
_MAX_MAP_INCHES = 16.0
_MAX_GRID_CELL_INCHES = 6.0
_MAX_TICK_LABELS = 64
_MAX_TICK_LABELS_SMALL = 32


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


def argmax_pattern(weights: np.ndarray) -> np.ndarray:
    """One-hot rows at each query's most attended key (ties to the first, as hardmax does; Hahn §3)."""
    weights = np.asarray(weights, dtype=float)
    pattern = np.zeros_like(weights)
    np.put_along_axis(pattern, weights.argmax(-1)[..., None], 1.0, axis=-1)
    return pattern


def attention_figures(view: AttentionView, *, argmax: bool = False) -> Iterator[tuple[str, Figure]]:
    """Every picture of ``view`` as (file stem, Figure), drawn one at a time.

    For each kind and layer: ``{kind}_layer{l}_head{h}`` per head, ``{kind}_layer{l}_heads`` (the
    grid of all heads), and with ``argmax`` (hard attention) ``{kind}_layer{l}_argmax``, the one-hot
    pattern of each query's chosen key, with the chosen cells also outlined on each head's map.
    A caller that keeps a figure owns it; close it with ``matplotlib.pyplot.close``. A head that
    was off (``view.off``: held by ``train.mask_heads`` or masked) is titled "(off)": its weights
    are drawn, but xi_h = 0 removed its output.
    """
    off = set(view.off)
    for kind, (queries, keys) in view.axes.items():
        maps = kind_maps(view, kind)
        title = KIND_TITLES.get(kind, kind)
        for layer, heads in enumerate(maps):
            names = [
                f"head {head}" + (" (off)" if HeadId(kind, layer, head) in off else "") for head in range(len(heads))
            ]
            for head, weights in enumerate(heads):
                yield (
                    f"{kind}_layer{layer}_head{head}",
                    head_heatmap(weights, queries, keys, title=f"{title}, layer {layer}, {names[head]}", argmax=argmax),
                )
            yield (
                f"{kind}_layer{layer}_heads",
                layer_grid(heads, queries, keys, title=f"{title}, layer {layer}", head_labels=names),
            )
            if argmax:
                yield (
                    f"{kind}_layer{layer}_argmax",
                    layer_grid(argmax_pattern(heads), queries, keys, title=f"{title}, layer {layer}: argmax pattern"),
                )


def save_attention_pictures(view: AttentionView, out_dir: Path, *, argmax: bool = False) -> list[Path]:
    """Write every picture of :func:`attention_figures` as ``out_dir/<stem>.png``; returns the paths."""
    out_dir = Path(out_dir)
    return [save_figure(figure, out_dir / f"{stem}.png") for stem, figure in attention_figures(view, argmax=argmax)]
