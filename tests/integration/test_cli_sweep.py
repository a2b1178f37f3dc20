"""``attnlab sweep`` on the command line: one JSON object, failures recorded, --report, bad grids (exit 2)."""

from __future__ import annotations

import csv
import json
import subprocess
from pathlib import Path

import pytest

from tests.cli import attnlab

TINY = """
[task]
name = "parity"
max_train_length = 6
train_size = 48
valid_size = 24
test_size = 16
length_generalisation_size = 16

[model]
kind = "encoder_classifier"
layers = 1
d_model = 8
heads = 2
d_ff = 16
dropout = 0.0

[train]
steps = 4
batch_size = 8
log_every = 2
schedule = "constant"
"""


def _one_error_line(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cli-sweep") / "tiny.toml"
    path.write_text(TINY)
    return path


@pytest.mark.parametrize(
    ("grid", "named"),
    [
        ("model.nonsense=1,2", "--grid model.nonsense=1: model.nonsense: unknown key"),
        ("model.attention=soft,fuzzy", "--grid model.attention=fuzzy: model.attention"),
        ("train.seed=1,2", "--grid train.seed: seeds are set by --seeds"),
    ],
)
def test_a_bad_grid_key_or_value_is_one_line_and_writes_nothing(config, tmp_path, grid, named):
    out = tmp_path / "sweep"
    line = _one_error_line(attnlab("sweep", str(config), "--grid", grid, "--out", str(out), "--no-progress"))
    assert named in line
    assert not out.exists()


def test_usage_errors(config, tmp_path):
    assert "--out" in _one_error_line(attnlab("sweep", str(config), "--grid", "model.heads=2"))
    assert "--seeds" in _one_error_line(attnlab("sweep", str(config), "--seeds", "3-1", "--out", str(tmp_path / "s")))
    assert "not a sweep folder" in _one_error_line(attnlab("sweep", "--report", str(tmp_path)))
    assert "--report" in _one_error_line(attnlab("sweep", str(config), "--report", str(tmp_path)))


def test_a_sweep_records_a_diverged_run_finishes_the_others_and_report_rebuilds(config, tmp_path):
    out = tmp_path / "sweep"
    result = attnlab("sweep", str(config), "--grid", "train.lr=0.001,1e9", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)  # one object on stdout, nothing else
    assert (summary["runs"], summary["ok"], summary["failed"], summary["trained"]) == (2, 1, 1, 2)
    with open(out / "results.csv", newline="", encoding="utf-8") as handle:
        rows = {row["train.lr"]: row for row in csv.DictReader(handle)}
    assert rows["0.001"]["status"] == "ok" and 0.0 <= float(rows["0.001"]["valid.accuracy"]) <= 1.0
    assert rows["1e9"]["status"] == "diverged" and rows["1e9"]["error"].startswith("the loss became nan at step")
    plots = [f"plots/accuracy_by_length-{split}.png" for split in ("valid", "test", "length_generalisation")]
    names = ["results.csv", "accuracy_by_length.csv", "summary.md", *plots]  # every split the sweep scores
    before = {name: (out / name).read_bytes() for name in names}
    for name in names:
        (out / name).unlink()
    rebuilt = attnlab("sweep", "--report", str(out), "--json")
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert sorted(json.loads(rebuilt.stdout)["files"]) == sorted(str(out / name) for name in names)
    assert {name: (out / name).read_bytes() for name in names} == before
    again = attnlab("sweep", str(config), "--grid", "train.lr=0.001,1e9", "--out", str(out), "--no-progress")
    assert again.returncode == 0, again.stderr
    assert "2 runs" in again.stdout and "0 trained now, 2 done before" in again.stdout
    line = _one_error_line(attnlab("sweep", str(config), "--grid", "train.lr=0.001", "--out", str(out)))
    assert "another grid" in line
