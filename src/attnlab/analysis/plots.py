"""The pictures of an attention view: every map drawn with :mod:`attnlab.figures`' heatmaps.

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

from attnlab.analysis.maps import AttentionView, kind_maps
from attnlab.errors import UsageError
from attnlab.figures import Figure, head_heatmap, layer_grid, plt
from attnlab.head_ids import KIND_TITLES, HeadId
from attnlab.run.storage import atomic_write

__all__ = ["argmax_pattern", "attention_figures", "save_attention_pictures", "select_layers"]

_DPI = 110
"""Pixels per inch of the PNG files (as :func:`attnlab.figures.save_figure` writes them)."""
_PNG_LEVEL = 1
"""zlib level of the PNG files :func:`save_attention_pictures` writes: level 1 encodes several
times faster than the default 6, for files about a third larger (flat heat cells compress well)."""


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
