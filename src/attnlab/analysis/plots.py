"""Attention heatmaps with matplotlib: one head, or a grid of every head of a layer.

"Visualising learned attentions: different heads show different patterns" (Li's slides). Each
function returns the matplotlib Figure (for notebooks) and, given ``path``, also writes a PNG.
Queries run down the rows, keys along the columns, with the tokens as tick labels.

:func:`attention_figures` draws every map of an :class:`~attnlab.analysis.maps.AttentionView`
(each head of each layer of each kind, one grid per layer, and for hard attention the argmax
pattern); :func:`save_attention_pictures` writes them all, as ``attnlab attention`` does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image

from attnlab.analysis.maps import KIND_TITLES, AttentionView, kind_maps
from attnlab.errors import UsageError
from attnlab.figures import Figure, plt, save_figure
from attnlab.head_ids import HeadId
from attnlab.run.storage import atomic_write

__all__ = [
    "head_heatmap",
    "layer_grid",
    "kind_grid",
    "argmax_pattern",
    "attention_figures",
    "save_attention_pictures",
    "select_layers",
    "save_figure",
]

_CMAP = "viridis"
_DPI = 110
"""Pixels per inch of the PNG files (as :func:`attnlab.figures.save_figure` writes them)."""
_PNG_LEVEL = 1
"""zlib level of the PNG files :func:`save_attention_pictures` writes: level 1 encodes several
times faster than the default 6, for files about a third larger (flat heat cells compress well)."""

# A map grows with its tokens up to these sizes, then its cells shrink and only every k-th token
# is labelled: a 160-token input had drawn 73-inch heatmaps and a 230-megapixel grid (4 GB, 3 min).
_MAX_MAP_INCHES = 16.0
_MAX_GRID_CELL_INCHES = 6.0
_MAX_KIND_GRID_INCHES = 24.0
"""The longer side of a :func:`kind_grid` (every layer and head of a kind): its cells shrink to fit."""
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


def argmax_pattern(weights: np.ndarray) -> np.ndarray:
    """One-hot rows at each query's most attended key (ties to the first, as hardmax does; Hahn §3)."""
    weights = np.asarray(weights, dtype=float)
    pattern = np.zeros_like(weights)
    np.put_along_axis(pattern, weights.argmax(-1)[..., None], 1.0, axis=-1)
    return pattern


@dataclass(frozen=True)
class _Picture:
    """One picture of a view, before it is drawn: a head's map ("head"), a layer's grid ("grid"),
    or a layer's argmax pattern ("argmax")."""

    stem: str
    shape: str
    kind: str
    weights: np.ndarray
    queries: Sequence[str]
    keys: Sequence[str]
    title: str
    labels: Sequence[str] | None = None
    argmax: bool = False


def select_layers(spec: str, count: int, *, flag: str = "--layers") -> tuple[int, ...]:
    """The layers a selection such as ``"0,5,29"``, ``"0-3"`` or ``"0,10-12"`` names, in order.

    Args:
        spec: comma-separated layer numbers and inclusive ranges ``a-b``.
        count: the model's layers (each named layer lies in ``[0, count)``).
        flag: how the person gave ``spec``, for the message.

    Raises:
        UsageError: a part is not a number or a range, or names a layer the model lacks.
    """
    chosen: list[int] = []
    for part in spec.split(","):
        first, dash, last = part.strip().partition("-")
        try:
            low, high = int(first), int(last if dash else first)
        except ValueError:
            raise UsageError(f"{flag}: {part.strip()!r} is not a layer or a range (e.g. 0,5,29 or 0-3)") from None
        if not 0 <= low <= high < count:
            raise UsageError(f"{flag}: {part.strip()!r} is not within the model's layers 0-{count - 1}")
        chosen.extend(layer for layer in range(low, high + 1) if layer not in chosen)
    return tuple(chosen)


def _pictures(view: AttentionView, *, argmax: bool, layers: Sequence[int] | None) -> Iterator[_Picture]:
    """Every picture of ``view`` (see :func:`attention_figures`), in order, not yet drawn."""
    off = set(view.off)
    for kind, (queries, keys) in view.axes.items():
        title = KIND_TITLES.get(kind, kind)
        maps = kind_maps(view, kind)
        for layer in range(len(maps)) if layers is None else [layer for layer in layers if layer < len(maps)]:
            heads = maps[layer]
            names = [
                f"head {head}" + (" (off)" if HeadId(kind, layer, head) in off else "") for head in range(len(heads))
            ]
            common = {"kind": kind, "queries": queries, "keys": keys}
            for head, weights in enumerate(heads):
                named = f"{title}, layer {layer}, {names[head]}"
                yield _Picture(
                    f"{kind}_layer{layer}_head{head}", "head", weights=weights, title=named, argmax=argmax, **common
                )
            yield _Picture(
                f"{kind}_layer{layer}_heads",
                "grid",
                weights=heads,
                title=f"{title}, layer {layer}",
                labels=names,
                **common,
            )
            if argmax:
                pattern = argmax_pattern(heads)
                named = f"{title}, layer {layer}: argmax pattern"
                yield _Picture(f"{kind}_layer{layer}_argmax", "argmax", weights=pattern, title=named, **common)


def _figure(picture: _Picture) -> Figure:
    if picture.shape == "head":
        return head_heatmap(picture.weights, picture.queries, picture.keys, title=picture.title, argmax=picture.argmax)
    return layer_grid(picture.weights, picture.queries, picture.keys, title=picture.title, head_labels=picture.labels)


def attention_figures(
    view: AttentionView, *, argmax: bool = False, layers: Sequence[int] | None = None
) -> Iterator[tuple[str, Figure]]:
    """Every picture of ``view`` as (file stem, Figure), drawn one at a time.

    For each kind and layer: ``{kind}_layer{l}_head{h}`` per head, ``{kind}_layer{l}_heads`` (the
    grid of all heads), and with ``argmax`` (hard attention) ``{kind}_layer{l}_argmax``, the one-hot
    pattern of each query's chosen key, with the chosen cells also outlined on each head's map.
    ``layers`` keeps only those layers (:func:`select_layers`; default every layer).
    A caller that keeps a figure owns it; close it with ``matplotlib.pyplot.close``. A head that
    was off (``view.off``: held by ``train.mask_heads`` or masked) is titled "(off)": its weights
    are drawn, but xi_h = 0 removed its output.
    """
    for picture in _pictures(view, argmax=argmax, layers=layers):
        yield picture.stem, _figure(picture)


def save_attention_pictures(
    view: AttentionView, out_dir: Path, *, argmax: bool = False, layers: Sequence[int] | None = None
) -> list[Path]:
    """Write every picture of :func:`attention_figures` as ``out_dir/<stem>.png``; returns the paths.

    Pictures of one layout (the same kind of picture, axes and head count) share one drawn figure:
    only the heat cells and titles are repainted for each (:class:`_Painter`), so that the 300
    pictures of a 30-layer, 9-head model take seconds, not minutes. They equal what
    :func:`attention_figures` draws.
    """
    out_dir = Path(out_dir)
    painters: dict[tuple, _Painter] = {}
    paths = []
    try:
        for picture in _pictures(view, argmax=argmax, layers=layers):
            key = (picture.shape, picture.kind, picture.weights.shape)
            if key not in painters:
                template = dataclasses.replace(picture, argmax=False)  # outlines are repainted per picture
                painters[key] = _Painter(_figure(template))
            path = out_dir / f"{picture.stem}.png"
            painters[key].save(picture, path)
            paths.append(path)
    finally:
        for painter in painters.values():
            plt.close(painter.fig)
    return paths


class _Painter:
    """Many pictures of one layout from one figure: the figure is drawn once without what changes
    (the images, their frames and the titles), then each picture repaints only those over a copy of it (blitting)."""

    def __init__(self, fig: Figure) -> None:
        self.fig = fig
        fig.set_dpi(_DPI)
        self.axes = [ax for ax in fig.axes if ax.images]  # the heat maps, not the colour bar
        self.titles = [ax.title for ax in self.axes] + list(fig.texts)  # fig.texts: the grid's suptitle
        changing = [*self.titles, *(artist for ax in self.axes for artist in (ax.images[0], *ax.spines.values()))]
        fig.canvas.draw()  # places the titles (a hidden title would be placed elsewhere)
        placed = [title.get_position() for title in self.titles]
        for artist in changing:
            artist.set_visible(False)
        fig.canvas.draw()
        self.background = fig.canvas.copy_from_bbox(fig.bbox)
        for artist in changing:
            artist.set_visible(True)
        for title, position in zip(self.titles, placed, strict=True):
            title.set_position(position)

    def save(self, picture: _Picture, path: Path) -> None:
        """Repaint ``picture`` (same layout as the figure) and write it as PNG at ``path``."""
        maps = picture.weights[None] if picture.shape == "head" else picture.weights
        fig, canvas = self.fig, self.fig.canvas
        canvas.restore_region(self.background)
        for index, ax in enumerate(self.axes):
            ax.images[0].set_data(maps[index])
            if picture.shape == "head":
                ax.title.set_text(picture.title)
            elif picture.labels:
                ax.title.set_text(picture.labels[index])
            else:
                ax.title.set_text(f"head {index}")
            for artist in (ax.images[0], *ax.spines.values(), ax.title):  # the frame lies over the cells
                fig.draw_artist(artist)
        if picture.shape != "head":
            fig.texts[0].set_text(picture.title)
            fig.draw_artist(fig.texts[0])
        elif picture.argmax:
            ax = self.axes[0]
            for row, col in enumerate(picture.weights.argmax(-1)):
                outline = plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.5)
                ax.add_patch(outline)
                fig.draw_artist(outline)
                outline.remove()
        picture_file = PIL.Image.fromarray(np.asarray(canvas.buffer_rgba())[..., :3])  # opaque: RGB
        atomic_write(path, lambda handle: picture_file.save(handle, format="png", compress_level=_PNG_LEVEL), "wb")
