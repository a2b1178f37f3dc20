"""train and eval with length bins, the next_char formulation and the shortcut baselines (tiny runs)."""

from __future__ import annotations

import json

import pytest

from attnlab.run.directory import RunDir
from tests.cli import attnlab

TINY = """
[task]
name = "dyck1"
formulation = "{formulation}"
max_train_length = 8
train_size = 200
valid_size = 20
test_size = 20
length_generalisation_size = 30
eval_lengths = [[9, 12], [13, 16]]
[model]
kind = "{kind}"
layers = 1
d_model = 16
heads = 2
d_ff = 32
[train]
steps = 4
batch_size = 8
log_every = 2
"""


@pytest.mark.parametrize(("formulation", "kind"), [("classify", "encoder_classifier"), ("next_char", "decoder_only")])
def test_length_bins_are_scored_at_the_end_and_by_eval(tmp_path, formulation, kind):
    config = tmp_path / "c.toml"
    config.write_text(TINY.format(formulation=formulation, kind=kind))
    run = tmp_path / "run"
    trained = attnlab("train", str(config), "--out", str(run), "--no-progress")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert "train split: 200 examples" in trained.stdout + trained.stderr
    records = RunDir.open(run).read_metrics()
    scored = {r["split"]: r for r in records if r.get("split")}
    # the training split's statistics, the bins, and the horizon over the bins together
    assert set(scored) == {"valid", "train", "length_9_12", "length_13_16", "length_bins"}
    assert 1 <= scored["train"]["depth_min"] <= scored["train"]["depth_max"] <= 4
    assert all(9 <= int(n) <= 12 for n in scored["length_9_12"]["accuracy_by_length"])
    assert (run / "plots" / "accuracy_by_length.png").exists()

    result = attnlab("eval", str(run), "--split", "length_13_16", "--json", "--no-progress")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(result.stdout)
    assert metrics["split"] == "length_13_16" and metrics["examples"] == 30
    assert metrics["positives"] == (30 if formulation == "next_char" else 15)
    assert 0 < metrics["distinct_strings"] <= 30
    assert metrics["length_range"] == [13, 16] and 12 <= metrics["horizon"] <= 16
    assert sum(metrics["examples_by_length"].values()) == 30
    if formulation == "classify":
        assert metrics["baseline"] == "balanced_counts" and 0.5 <= metrics["baseline_accuracy"] <= 0.75
        text = attnlab("eval", str(run), "--split", "length_9_13", "--no-progress")
        assert text.returncode == 2
        assert text.stderr.strip().splitlines()[-1].startswith("error: --split: unknown split 'length_9_13'")
    else:
        assert "baseline" not in metrics and 0 <= metrics["token_accuracy"] <= 1


def test_bins_longer_than_the_model_reads_are_refused_before_training(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(
        TINY.format(formulation="classify", kind="encoder_classifier").replace("d_ff = 32", "d_ff = 32\nmax_len = 14")
    )
    result = attnlab("train", str(config), "--out", str(tmp_path / "run"), "--no-progress")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == (
        "error: task.eval_lengths: the longest bin needs 17 positions, more than the model's max_length=14; "
        "raise model.max_len (or train.max_length) or shorten the bins"
    )
    assert not (tmp_path / "run" / "model.safetensors").exists()
