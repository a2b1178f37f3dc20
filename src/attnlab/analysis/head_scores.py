"""One score per head, as tensors: what importance, ablation, detection, attribution and patching
give back to Python.

A :class:`HeadScores` holds, for each attention kind of the model (``self`` for a language model;
``encoder_self``, ``decoder_self``, ``cross`` for an encoder-decoder), a (layers, heads) tensor
whose entry ``[L, h]`` is head h of layer L: the index of :meth:`attnlab.LanguageModel.head_mask`'s
xi. Scores with a position axis (patching position by position) are (layers, heads, positions).
The tables people read come from the same tensors: :meth:`HeadScores.rows`, :meth:`~HeadScores.to_frame`
(pandas), :meth:`~HeadScores.to_csv`, and a heatmap (:meth:`~HeadScores.plot`, a matplotlib
Figure a notebook draws).

Dimensions: layers x heads [x positions], float64 on the CPU.
"""

from __future__ import annotations

import csv
import io
import itertools
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.analysis.plots import heads_heatmap
from attnlab.analysis.reports import data_frame
from attnlab.errors import UsageError
from attnlab.figures import Figure
from attnlab.head_ids import HeadId
from attnlab.run.storage import atomic_write_text

__all__ = ["HeadScores"]


@dataclass(frozen=True)
class HeadScores(Mapping[str, Tensor]):
    """A score for every head, by attention kind: ``scores["self"]`` is a (layers, heads) tensor.

    Attributes:
        name: what the score is, for people and for the CSV's column (``importance``, ``delta``,
            ``induction``, ``restored``, ``direct effect``).
        values: kind -> (layers, heads) or (layers, heads, positions) float64 tensor on the CPU;
            NaN where a head is not scored.
        dims: the names of the tensors' dimensions, ``("layer", "head")`` or with ``"position"``.
        tokens: the tokens along ``position``, when there is one.
    """

    name: str
    values: dict[str, Tensor]
    dims: tuple[str, ...] = ("layer", "head")
    tokens: list[str] = field(default_factory=list)

    # ---- a mapping of kinds to tensors -------------------------------------------------------------

    def __getitem__(self, kind: str) -> Tensor:
        if kind not in self.values:
            raise UsageError(f"kind: {self.name} has scores of {', '.join(self.values)}, not {kind!r}")
        return self.values[kind]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    @property
    def tensor(self) -> Tensor:
        """The tensor of a model with one attention kind (a language model's ``self``)."""
        if len(self.values) != 1:
            raise UsageError(f"tensor: this model has heads of {len(self.values)} kinds; index by kind: {list(self)}")
        return next(iter(self.values.values()))

    # ---- heads ranked -----------------------------------------------------------------------------

    def rows(self) -> list[tuple[HeadId, float]]:
        """Every scored head with its score (summed over positions, if any), in the model's order."""
        found = []
        for kind, values in self.values.items():
            per_head = values if values.dim() == 2 else values.sum(-1)
            for (layer, head), value in zip(_indices(per_head), per_head.flatten().tolist(), strict=True):
                if value == value:  # NaN: not scored
                    found.append((HeadId(kind, layer, head), float(value)))
        return found

    def top(self, count: int = 5, *, absolute: bool = False) -> list[tuple[HeadId, float]]:
        """The ``count`` heads scoring highest (by |score| with ``absolute``), highest first."""
        return sorted(self.rows(), key=lambda row: -(abs(row[1]) if absolute else row[1]))[:count]

    # ---- tables and pictures ------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        """One dict per entry: kind, layer, head (, position, token) and the score."""
        found = []
        for kind, values in self.values.items():
            for index, value in zip(_indices(values), values.flatten().tolist(), strict=True):
                record: dict[str, Any] = {"kind": kind, **dict(zip(self.dims, index, strict=True))}
                if "position" in self.dims and self.tokens:
                    record["token"] = self.tokens[index[-1]]
                found.append({**record, self.name: value})
        return found

    def to_frame(self) -> Any:
        """A pandas DataFrame of :meth:`records` (:func:`attnlab.analysis.reports.data_frame`)."""
        return data_frame(self.records())

    def to_csv(self, path: str | os.PathLike[str]) -> Path:
        """Write :meth:`records` as CSV (atomically) and return the path."""
        records = self.records()
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=list(records[0]) if records else ["kind"], lineterminator="\n")
        writer.writeheader()
        writer.writerows({k: (f"{v:.9g}" if isinstance(v, float) else v) for k, v in r.items()} for r in records)
        atomic_write_text(Path(path), buffer.getvalue())
        return Path(path)

    def plot(self, kind: str | None = None, *, path: str | os.PathLike[str] | None = None) -> Figure:
        """A heatmap of one kind's scores (default: the only kind), layers down and heads across
        (:func:`attnlab.analysis.plots.heads_heatmap`); also written as PNG to ``path``."""
        values = self.tensor if kind is None else self[kind]
        title = self.name if kind is None else f"{self.name} ({kind})"
        saved = None if path is None else Path(path)
        return heads_heatmap(values, title=title, colorbar=self.name, tokens=self.tokens or None, path=saved)

    @classmethod
    def of_rows(
        cls, name: str, rows: Sequence[Any], value: str, shapes: Mapping[str, tuple[int, int]] | None = None
    ) -> HeadScores:
        """The scores of rows with ``kind``, ``layer``, ``head`` and the attribute ``value``, on
        the model's head-mask ``shapes`` (default: as far as the rows reach); NaN for heads
        without a row, and kinds without any row left out."""
        if shapes is None:
            shapes = {}
            for row in rows:
                layers, heads = shapes.get(row.kind, (0, 0))
                shapes[row.kind] = (max(layers, row.layer + 1), max(heads, row.head + 1))
        values = {kind: torch.full(shape, float("nan"), dtype=torch.float64) for kind, shape in shapes.items()}
        for row in rows:
            values[row.kind][row.layer, row.head] = float(getattr(row, value))
        return cls(name, {kind: tensor for kind, tensor in values.items() if not bool(tensor.isnan().all())})


def _indices(values: Tensor) -> list[tuple[int, ...]]:
    """Every index of ``values`` in row-major order (the order of ``values.flatten()``)."""
    return list(itertools.product(*map(range, values.shape)))
