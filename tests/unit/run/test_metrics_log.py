"""metrics.jsonl against a checkpoint's record: the covered prefix exact, later lines only parsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab.errors import CheckpointError
from attnlab.run.metrics_log import MetricsRecord, MetricsTally, check_metrics_bytes

PATH = Path("RUN/metrics.jsonl")
LINES = [b'{"loss": 2.5, "step": 1}\n', b'{"loss": 2.25, "step": 2}\n']


def _record(data: bytes) -> MetricsRecord:
    tally = MetricsTally()
    for line in data.splitlines(keepends=True):
        tally.add(line)
    return tally.record()


def test_the_tally_of_appended_lines_equals_the_tally_of_their_bytes():
    data = b"".join(LINES)
    assert (
        _record(data) == MetricsTally(data).record() == MetricsRecord(2, len(data), MetricsTally(data).record().sha256)
    )


def test_the_recorded_prefix_must_be_exact_and_later_lines_are_counted():
    data = b"".join(LINES)
    record = _record(LINES[0])
    check = check_metrics_bytes(data + b'{"loss": 2', record, path=PATH, checkpoint="step-00000001")
    assert (check.covered, check.uncovered, check.torn) == (1, 1, True)
    assert [r["step"] for r in check.records] == [1, 2]
    assert check.describe().startswith("1 lines as checkpoint step-00000001 recorded them; 1 later lines")
    for damaged, says in [
        (data.replace(b"2.5", b"2.6"), "its first 25 bytes differ from what checkpoint step-00000001 recorded"),
        (data[:10], "cut to 10 bytes"),
        (b"", "cut to 0 bytes"),
    ]:
        with pytest.raises(CheckpointError, match=f"^metrics {PATH} is damaged: {says}"):
            check_metrics_bytes(damaged, record, path=PATH, checkpoint="step-00000001")


def test_without_a_record_every_line_is_parsed_and_garbage_named():
    check = check_metrics_bytes(b"".join(LINES), None, path=PATH, checkpoint=None)
    assert check.describe() == "2 lines parsed; no checkpoint records this file yet"
    with pytest.raises(CheckpointError, match=f"^{PATH}:2: not valid JSON"):
        check_metrics_bytes(LINES[0] + b"garbage\n", None, path=PATH, checkpoint=None)


@pytest.mark.parametrize(
    "value",
    [
        None,
        [],
        {"lines": 1, "size": 2},
        {"lines": -1, "size": 2, "sha256": "0" * 64},
        {"lines": True, "size": 2, "sha256": "0" * 64},
    ],
)
def test_a_malformed_record_is_named(value):
    with pytest.raises(CheckpointError, match="trainer state T is corrupted: its metrics record is malformed"):
        MetricsRecord.from_dict(value, path=Path("T"))
