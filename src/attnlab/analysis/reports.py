"""CSV files and pictures of head analysis: per-head heatmaps (layers x heads), per-layer bars, token
grids (the logit lens) and pruning curves."""

from __future__ import annotations

import csv
import dataclasses
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from attnlab.errors import UsageError
from attnlab.figures import plt, save_figure
from attnlab.run.storage import atomic_write_text

__all__ = ["write_rows", "data_frame", "head_matrix_plot", "layer_bars_plot", "token_grid_plot", "curve_plot"]


def write_rows(rows: Sequence[Any], path: Path, columns: Sequence[str]) -> Path:
    """Write dataclass rows as CSV with exactly ``columns``, atomically (text cells quoted as CSV
    needs: a token may hold a comma or a quote)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        values = dataclasses.asdict(row)
        writer.writerow([_cell(values[c]) for c in columns])
    atomic_write_text(Path(path), buffer.getvalue())
    return Path(path)


def data_frame(records: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> Any:
    """A pandas DataFrame of ``records`` (one dict per row), for notebooks: pandas is not a
    dependency of attnlab, so without it this is a UsageError that names the CSV writers instead."""
    try:
        import pandas  # lazy: an optional package, for notebooks
    except ImportError:
        raise UsageError("to_frame: needs pandas (pip install pandas); to_csv writes the same table") from None
    return pandas.DataFrame.from_records(list(records), columns=None if columns is None else list(columns))


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def read_importance_csv(path: Path) -> list[dict[str, Any]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return [
            {"kind": r["kind"], "layer": int(r["layer"]), "head": int(r["head"]), "importance": float(r["importance"])}
            for r in csv.DictReader(handle)
        ]


LABEL_SHARE = 0.01
"""A layer x head cell is labelled with its value when that is at least this share of the largest
|value|: a 30 x 9 grid of SmolLM2's heads had labels such as -4.1e-05 running into each other."""


def head_matrix_plot(rows: Sequence[Any], value: str, path: Path, *, title: str, diverging: bool = False) -> Path:
    """One panel per attention kind: layers down, heads across, coloured by ``value``."""
    kinds = list(dict.fromkeys(r.kind for r in rows))
    most_layers = max((r.layer for r in rows), default=0) + 1
    most_heads = max((r.head for r in rows), default=0) + 1
    panel = max(3.2, 0.5 * most_heads)  # a cell wide and tall enough for its value (SmolLM2: 30 x 9)
    fig, axes = plt.subplots(
        1, len(kinds), figsize=(panel * len(kinds) + 0.8, max(2.8, 1.2 + 0.25 * most_layers)), squeeze=False
    )
    values = np.array([getattr(r, value) for r in rows], dtype=float)
    limit = float(np.nanmax(np.abs(values))) if len(values) else 1.0
    limit = limit or 1.0
    for ax, kind in zip(axes[0], kinds):
        kind_rows = [r for r in rows if r.kind == kind]
        layers = max(r.layer for r in kind_rows) + 1
        heads = max(r.head for r in kind_rows) + 1
        matrix = np.full((layers, heads), np.nan)
        for r in kind_rows:
            matrix[r.layer, r.head] = getattr(r, value)
        cmap, vmin = ("RdBu", -limit) if diverging else ("viridis", 0.0)
        image = ax.imshow(matrix, cmap=cmap, vmin=vmin, vmax=limit, aspect="auto")
        for (i, j), v in np.ndenumerate(matrix):
            if not np.isnan(v) and abs(v) >= LABEL_SHARE * limit:  # smaller values read as their colour
                bright = not diverging and v > 0.6 * limit  # viridis turns yellow: dark text there
                ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7,
                        color="black" if diverging or bright else "white")  # fmt: skip
        ax.set_title(kind, fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(heads))
        ax.set_yticks(range(layers))
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def position_matrix_plot(rows: Sequence[Any], value: str, path: Path, *, tokens: Sequence[str], title: str) -> Path:
    """Sites down (``layer`` and ``site`` of each row: the residual stream entering each layer,
    then the last layer's output), positions across labelled with ``tokens``, coloured by
    ``value`` on a diverging scale."""
    sites = list(dict.fromkeys((r.layer, r.site) for r in rows))
    matrix = np.full((len(sites), len(tokens)), np.nan)
    for r in rows:
        matrix[sites.index((r.layer, r.site)), r.position] = getattr(r, value)
    limit = float(np.nanmax(np.abs(matrix))) if rows else 1.0
    width = min(24.0, 1.5 + 0.45 * len(tokens))
    fig, ax = plt.subplots(figsize=(width, 1.2 + 0.28 * len(sites)))
    image = ax.imshow(matrix, cmap="RdBu", vmin=-(limit or 1.0), vmax=limit or 1.0, aspect="auto")
    ax.set_xticks(range(len(tokens)))
    ax.set_xticklabels(tokens, rotation=90, fontsize=7, parse_math=False)  # a token may hold "$"
    ax.set_yticks(range(len(sites)))
    ax.set_yticklabels([f"{layer} {site}" for layer, site in sites], fontsize=7)
    ax.set_xlabel("position (token of the corrupt input)")
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def layer_bars_plot(rows: Sequence[Any], values: Sequence[str], path: Path, *, title: str, ylabel: str) -> Path:
    """Grouped bars: one group per row's ``layer``, one bar per name in ``values`` (e.g. a layer's
    attention and FFN contributions), with a line at zero."""
    layers = [r.layer for r in rows]
    width = 0.8 / max(1, len(values))
    fig, ax = plt.subplots(figsize=(min(16.0, 2.5 + 0.12 * len(rows) * len(values)), 3.5))
    for index, value in enumerate(values):
        offsets = np.array(layers, dtype=float) + (index - (len(values) - 1) / 2) * width
        ax.bar(offsets, [getattr(r, value) for r in rows], width=width, label=value)
    ax.axhline(0.0, color="black", linewidth=0.6)
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def token_grid_plot(
    labels: Sequence[Sequence[str]],
    values: np.ndarray,
    path: Path,
    *,
    rows: Sequence[str],
    columns: Sequence[str],
    title: str,
    colorbar: str,
) -> Path:
    """A grid coloured by ``values`` (rows x columns, in [0, 1]) with a token written in each cell
    (e.g. the logit lens: residual streams down, positions across, the most likely next token)."""
    height, width = values.shape
    fig, ax = plt.subplots(figsize=(min(28.0, 2.0 + 0.9 * width), min(28.0, 1.2 + 0.3 * height)))
    image = ax.imshow(values, cmap="Blues", vmin=0.0, vmax=1.0, aspect="auto")
    for (i, j), value in np.ndenumerate(values):
        text = labels[i][j]
        shown = text if len(text) <= 8 else text[:7] + "…"
        color = "white" if value > 0.6 else "black"
        ax.text(j, i, shown, ha="center", va="center", fontsize=6, color=color, parse_math=False)
    ax.set_xticks(range(width))
    ax.set_xticklabels(columns, rotation=90, fontsize=7, parse_math=False)  # a token may hold "$"
    ax.set_yticks(range(height))
    ax.set_yticklabels(rows, fontsize=7)
    fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04, label=colorbar)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)


def curve_plot(rows: Sequence[Any], path: Path, *, metric: str, title: str) -> Path:
    """The metric against the percentage of heads pruned."""
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot([r.percent for r in rows], [r.metric for r in rows], "o-")
    ax.set_xlabel("heads pruned (%)")
    ax.set_ylabel(metric)
    ax.set_xlim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return save_figure(fig, path)
