"""metrics.jsonl: one JSON object per line, and the record each checkpoint keeps of it.

A run appends its metric records to ``RUN/metrics.jsonl`` as it trains. The file only grows between
checkpoints, so each checkpoint records what it held then: its number of lines, its size in bytes
and the SHA-256 of those bytes (a :class:`MetricsRecord`, kept in the checkpoint's
``trainer_state.json`` under ``"metrics"``, itself covered by the checkpoint's manifest). Whatever a
reader finds, the file's first ``size`` bytes must be exactly what the checkpoint ``checkpoint.json``
names recorded: a flipped digit, a cut, an emptied or a deleted file is a
:class:`~attnlab.errors.CheckpointError` naming it. The lines after that point were written after the
last checkpoint (by a run still training, or killed before its next checkpoint): no record covers
them yet, so they are only parsed (a torn last line, what a kill mid-append leaves, is allowed), the
verdict says how many they are, and ``--resume`` drops them (it restarts from the checkpoint, which
logs them again).

The writer hashes the bytes it appends as it writes them (:class:`MetricsTally`), never bytes read
back, except once for a file it did not start (an old run being resumed, whose kept prefix it
rewrote itself).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab.errors import CheckpointError

__all__ = ["MetricsRecord", "MetricsTally", "MetricsCheck", "parse_metrics", "check_metrics_bytes"]

KEY = "metrics"
"""The key of the record in a checkpoint's trainer_state.json."""


@dataclass(frozen=True)
class MetricsRecord:
    """What metrics.jsonl held when a checkpoint was written: lines, bytes and their SHA-256."""

    lines: int
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"lines": self.lines, "size": self.size, "sha256": self.sha256}

    @classmethod
    def from_dict(cls, value: Any, *, path: Path) -> MetricsRecord:
        """The record stored in the trainer state ``path``.

        Raises:
            CheckpointError: the record is not ``{"lines": N, "size": N, "sha256": HEX}``.
        """
        counts_ok = isinstance(value, dict) and all(
            isinstance(value.get(key), int) and not isinstance(value.get(key), bool) and value[key] >= 0
            for key in ("lines", "size")
        )
        digest = value.get("sha256") if isinstance(value, dict) else None
        if not counts_ok or not isinstance(digest, str) or len(digest) != 64:
            raise CheckpointError(f"trainer state {path} is corrupted: its {KEY} record is malformed")
        return cls(value["lines"], value["size"], digest)


class MetricsTally:
    """The running record of the bytes appended to metrics.jsonl by this process."""

    def __init__(self, data: bytes = b"") -> None:
        self._digest = hashlib.sha256(data)
        self._lines = data.count(b"\n")
        self._size = len(data)

    def add(self, line: bytes) -> None:
        self._digest.update(line)
        self._lines += line.count(b"\n")
        self._size += len(line)

    def record(self) -> MetricsRecord:
        return MetricsRecord(self._lines, self._size, self._digest.copy().hexdigest())


@dataclass(frozen=True)
class MetricsCheck:
    """The records of metrics.jsonl and how far a checkpoint's record covers them.

    ``covered`` lines are the ones the checkpoint ``checkpoint`` recorded (0 and None: no checkpoint
    records the file); ``uncovered`` complete lines follow them; ``torn`` is True when a torn last
    line (a kill mid-append) was left out of ``records``."""

    records: list[dict[str, Any]]
    covered: int
    uncovered: int
    checkpoint: str | None
    torn: bool = False

    def describe(self) -> str:
        """One phrase for ``attnlab verify``: what was checked, and what could not be."""
        if self.checkpoint is None:
            text = f"{len(self.records)} lines parsed; no checkpoint records this file yet"
        else:
            text = f"{self.covered} lines as checkpoint {self.checkpoint} recorded them"
            if self.uncovered:
                text += (
                    f"; {self.uncovered} later lines (written after that checkpoint) only parsed: "
                    f"no record covers them yet and --resume drops them"
                )
        return text + ("; a torn last line ignored" if self.torn else "")


def check_metrics_bytes(
    data: bytes, record: MetricsRecord | None, *, path: Path, checkpoint: str | None
) -> MetricsCheck:
    """Check the bytes of metrics.jsonl against the record of ``checkpoint`` (None: no record) and
    parse every line.

    Raises:
        CheckpointError: the first ``record.size`` bytes are missing or differ from the record, or a
            line is not a JSON object; the message names ``path`` (and the line).
    """
    covered = 0
    if record is not None:
        where = f"checkpoint {checkpoint} recorded {record.lines} lines, {record.size} bytes"
        if len(data) < record.size:
            raise CheckpointError(f"metrics {path} is damaged: cut to {len(data)} bytes; {where}")
        prefix = data[: record.size]
        if hashlib.sha256(prefix).hexdigest() != record.sha256 or prefix.count(b"\n") != record.lines:
            raise CheckpointError(f"metrics {path} is damaged: its first {record.size} bytes differ from what {where}")
        covered = record.lines
    records, torn = parse_metrics(data, path=path)
    return MetricsCheck(records, covered, len(records) - covered, checkpoint, torn)


def parse_metrics(data: bytes, *, path: Path) -> tuple[list[dict[str, Any]], bool]:
    """Every complete record of metrics.jsonl's bytes, and whether a torn last line was dropped.

    A torn line is what an append killed mid-write leaves: a last line without its newline that
    starts like a record (ASCII, ``{``). Anything else malformed is an error.

    Raises:
        CheckpointError: a line that is not UTF-8, not JSON or not an object; names file:line.
    """
    lines = data.split(b"\n")
    last = lines.pop()  # b"" when the data ends with a newline
    records = [_metric_record(line, path, number) for number, line in enumerate(lines, start=1)]
    if not last:
        return records, False
    try:
        records.append(_metric_record(last, path, len(lines) + 1))
    except CheckpointError:
        if not (last.isascii() and last.startswith(b"{")):
            raise
        return records, True
    return records, False


def _metric_record(line: bytes, path: Path, number: int) -> dict[str, Any]:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise CheckpointError(f"{path}:{number}: bytes that are not UTF-8") from None
    except (json.JSONDecodeError, RecursionError):
        raise CheckpointError(f"{path}:{number}: not valid JSON") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path}:{number}: not a JSON object")
    return record
