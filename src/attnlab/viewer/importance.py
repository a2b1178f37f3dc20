"""Head importance from the CSV of ``attnlab heads importance``, to colour heads in the viewer.

The file has the header ``kind,layer,head,importance`` (more columns are ignored) and one row per
head (Michel §3: I_h, the expected sensitivity of the loss to ξ_h). Kinds, layers and heads are
checked against the model; a head left out has no colour. Problems are :class:`DataError`\\ s
naming the line.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Collection
from pathlib import Path

from attnlab.errors import DataError
from attnlab.head_ids import HeadId

__all__ = ["Importance", "parse_importance", "read_importance", "MAX_IMPORTANCE_BYTES"]

Importance = dict[str, list[list[float | None]]]
"""kind -> [layer][head] -> importance, or None for a head the file does not list."""

MAX_IMPORTANCE_BYTES = 1_000_000
_COLUMNS = ("kind", "layer", "head", "importance")


def read_importance(path: str | Path, heads: Collection[HeadId]) -> Importance:
    """Read and check an importance CSV file (see :func:`parse_importance`)."""
    path = Path(path)
    try:
        if path.is_file() and path.stat().st_size > MAX_IMPORTANCE_BYTES:  # checked before reading it
            raise DataError(f"{path}: larger than {MAX_IMPORTANCE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the importance CSV: {error}") from None
    return parse_importance(text, heads, source=str(path))


def parse_importance(text: str, heads: Collection[HeadId], *, source: str = "importance CSV") -> Importance:
    """Parse ``text`` for a model with ``heads`` (:func:`attnlab.head_ids.head_ids`)."""
    if len(text.encode("utf-8")) > MAX_IMPORTANCE_BYTES:
        raise DataError(f"{source}: larger than {MAX_IMPORTANCE_BYTES} bytes")
    reader = csv.DictReader(io.StringIO(text))
    try:
        table, rows = _read_rows(reader, heads, source)
    except csv.Error as error:  # a field over csv's size limit, a NUL byte
        raise DataError(f"{source}: line {reader.line_num + 1}: not CSV: {error}") from None
    if rows == 0:
        raise DataError(f"{source}: no rows after the header")
    return table


def _read_rows(reader: csv.DictReader, heads: Collection[HeadId], source: str) -> tuple[Importance, int]:
    """The table of ``reader``'s rows and how many there were; csv.Error passes through."""
    missing = [column for column in _COLUMNS if column not in (reader.fieldnames or [])]
    if missing:
        raise DataError(f"{source}: line 1: the header must name {','.join(_COLUMNS)}; missing {', '.join(missing)}")
    table = _empty_table(heads)
    rows = 0
    for row in reader:
        where = f"{source}: line {reader.line_num}"
        head, value = _parse_row(row, heads, where)
        if table[head.kind][head.layer][head.head] is not None:
            raise DataError(f"{where}: {head.kind} layer {head.layer} head {head.head} is listed twice")
        table[head.kind][head.layer][head.head] = value
        rows += 1
    return table, rows


def _empty_table(heads: Collection[HeadId]) -> Importance:
    table: Importance = {}
    for head in sorted(heads):
        layers = table.setdefault(head.kind, [])
        while len(layers) <= head.layer:
            layers.append([])
        row = layers[head.layer]
        row.extend([None] * (head.head + 1 - len(row)))
    return table


def _parse_row(row: dict[str | None, str | None], heads: Collection[HeadId], where: str) -> tuple[HeadId, float]:
    if None in row or any(row.get(column) is None for column in _COLUMNS):
        raise DataError(f"{where}: expected the {len(_COLUMNS)} fields of the header")
    kind = (row["kind"] or "").strip()
    kinds = sorted({h.kind for h in heads})
    if kind not in kinds:
        raise DataError(f"{where}: this model has no {kind!r} attention; it has: {', '.join(kinds)}")
    layer, head = _integer(row["layer"], f"{where}: layer"), _integer(row["head"], f"{where}: head")
    if HeadId(kind, layer, head) not in heads:
        raise DataError(f"{where}: this model has no head {head} in {kind} layer {layer}")
    try:
        value = float(row["importance"] or "")
    except ValueError:
        raise DataError(f"{where}: importance {row['importance']!r} is not a number") from None
    if not math.isfinite(value):
        raise DataError(f"{where}: importance must be finite, got {value}")
    return HeadId(kind, layer, head), value


def _integer(text: str | None, where: str) -> int:
    try:
        return int((text or "").strip())
    except ValueError:
        raise DataError(f"{where} {text!r} is not an integer") from None
