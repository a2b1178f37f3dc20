"""The pictures of an attention view: every map drawn with :mod:`attnlab.figures`' heatmaps.

:func:`attention_figures` draws every map of an :class:`~attnlab.analysis.maps.AttentionView`
(each head of each layer of each kind, one grid per layer, and for hard attention the argmax
pattern); :func:`save_attention_pictures` writes them all, as ``attnlab attention`` does.
:func:`heads_heatmap` draws a number per head (layers x heads), or per head and position, such as
what patching, attribution or a detector found.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from torch import Tensor

from attnlab.analysis.maps import AttentionView, kind_maps
from attnlab.errors import UsageError
from attnlab.figures import Figure, head_heatmap, layer_grid, plt, save_figure
from attnlab.head_ids import KIND_TITLES, HeadId
from attnlab.run.storage import atomic_write

__all__ = ["argmax_pattern", "attention_figures", "heads_heatmap", "save_attention_pictures", "select_layers"]

_DPI = 110
"""Pixels per inch of the PNG files (as :func:`attnlab.figures.save_figure` writes them)."""
_PNG_LEVEL = 1
"""zlib level of the PNG files :func:`save_attention_pictures` writes: level 1 encodes several
times faster than the default 6, for files about a third larger (flat heat cells compress well)."""
LABEL_SHARE = 0.01
"""A cell of :func:`heads_heatmap` is written with its value when that is at least this share of the
largest |value| (smaller ones read as their colour, and would run into each other)."""
MAX_LABELLED_CELLS = 400
"""Most cells :func:`heads_heatmap` writes values into; a larger picture is colour only."""
_MAX_HEADS_INCHES = 16.0
"""The longer side of a :func:`heads_heatmap` picture, at most."""


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


def heads_heatmap(
    values: Tensor | np.ndarray,
    *,
    title: str = "",
    colorbar: str = "",
    tokens: Sequence[str] | None = None,
    reduce: str | None = None,
    diverging: bool | None = None,
    path: Path | None = None,
) -> Figure:
    """A number per head as a heatmap: layers down, heads across (or, per position, one row per head
    and a column per token), each cell written with its value where the picture is small enough.

    Args:
        values: (layers, heads), or (layers, heads, positions): drawn per position, or summed over
            the positions with ``reduce="sum"``. NaN cells (a head a pruned layer lacks) are blank.
        title: the line above the picture.
        colorbar: the colour bar's label (what the numbers are, e.g. "logit difference restored").
        tokens: the labels of the positions (per-position pictures only; default their numbers).
        reduce: None, or ``"sum"`` to sum (layers, heads, positions) over the positions.
        diverging: a scale centred on 0 (red below, blue above); default: where a value is negative.
        path: also write the picture there as PNG (:func:`attnlab.figures.save_figure`, which closes it).

    Returns:
        The matplotlib Figure (Jupyter draws it; close it with ``plt.close``).

    Raises:
        UsageError: ``values`` not of 2 or 3 dimensions or empty, ``reduce`` unknown, or ``tokens``
            not one label a position.
    """
    matrix = _as_array(values)
    if reduce not in (None, "sum"):
        raise UsageError(f"reduce: unknown {reduce!r}; allowed: None, 'sum'")
    if matrix.ndim == 3 and reduce == "sum":
        matrix = np.nansum(matrix, axis=2)
    if matrix.ndim == 2:
        rows, columns = [f"{layer}" for layer in range(matrix.shape[0])], [f"{h}" for h in range(matrix.shape[1])]
        axis_names, rotation = ("head", "layer"), 0
    else:
        layers, heads, positions = matrix.shape
        if tokens is not None and len(tokens) != positions:
            raise UsageError(f"tokens: {len(tokens)} labels for {positions} positions")
        rows = [f"L{layer} H{head}" for layer in range(layers) for head in range(heads)]
        columns = [str(token) for token in tokens] if tokens is not None else [str(i) for i in range(positions)]
        matrix = matrix.reshape(layers * heads, positions)
        axis_names, rotation = ("position", "layer and head"), 90
    finite = matrix[np.isfinite(matrix)]
    limit = float(np.abs(finite).max()) if finite.size else 0.0
    limit = limit or 1.0
    if diverging is None:
        diverging = bool(finite.size and finite.min() < 0)
    cell = min(0.5, _MAX_HEADS_INCHES / max(len(rows), len(columns)))
    fig, ax = plt.subplots(figsize=(max(3.2, 1.6 + cell * len(columns)), max(2.4, 1.2 + cell * len(rows))))
    cmap, vmin = ("RdBu", -limit) if diverging else ("viridis", min(0.0, float(finite.min()) if finite.size else 0.0))
    image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=limit, aspect="auto", interpolation="nearest")
    if matrix.size <= MAX_LABELLED_CELLS:
        for (i, j), value in np.ndenumerate(matrix):
            if np.isfinite(value) and abs(value) >= LABEL_SHARE * limit:
                # white text on a dark cell: RdBu's ends, viridis' low values (it turns yellow above)
                dark = abs(value) > 0.6 * limit if diverging else value < vmin + 0.6 * (limit - vmin)
                ax.text(j, i, f"{value:.2g}", ha="center", va="center", fontsize=7, color="white" if dark else "black")
    ax.set_xticks(range(len(columns)))
    ax.set_xticklabels(columns, rotation=rotation, fontsize=7, parse_math=False)  # a token may hold "$"
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(rows, fontsize=7)
    ax.set_xlabel(axis_names[0])
    ax.set_ylabel(axis_names[1])
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).set_label(colorbar)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig


def _as_array(values: Tensor | np.ndarray) -> np.ndarray:
    """``values`` as a float64 array of 2 or 3 dimensions, checked."""
    if isinstance(values, Tensor):
        values = values.detach().to(device="cpu", dtype=torch.float64).numpy()
    matrix = np.asarray(values, dtype=float)
    if matrix.ndim not in (2, 3) or matrix.size == 0:
        raise UsageError(
            f"values: shape {tuple(matrix.shape)}; expected (layers, heads) or (layers, heads, positions), not empty"
        )
    return matrix
