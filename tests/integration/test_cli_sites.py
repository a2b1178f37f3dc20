"""`attnlab sites RUN`: the named sites of a run's model with their shapes; --match; --json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.experiment import ExperimentConfig
from attnlab.nn.hooks import model_sites
from attnlab.run.loaded import open_run
from attnlab.training.trainer import train
from tests.cli import attnlab

EXPERIMENT = {
    "task": {"name": "reverse", "max_train_length": 4, "train_size": 60, "valid_size": 10, "test_size": 10},
    "model": {"kind": "encoder_decoder", "layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
    "train": {"steps": 2, "batch_size": 8, "log_every": 0},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sites") / "run"
    train(ExperimentConfig.from_dict(EXPERIMENT), path, progress=False)
    return path


def test_sites_lists_every_site_with_its_shape(run):
    result = attnlab("sites", str(run), "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)["sites"]
    assert [row["name"] for row in rows] == list(model_sites(open_run(run).model))
    by_name = {row["name"]: row for row in rows}
    assert by_name["decoder.1.cross.pattern"] == {
        "name": "decoder.1.cross.pattern",
        "shape": "(B, 2, T, T_k)",
        "kind": "cross",
        "layer": 1,
        "heads": True,
    }
    assert by_name["encoder.0.resid_pre"]["shape"] == "(B, T, 16)" and not by_name["encoder.0.resid_pre"]["heads"]
    assert by_name["logits"]["shape"].startswith("(B, T, ")
    # the points inside norms, before rotary positions and before the FFN's activation
    assert by_name["encoder.0.attn_norm.scale"]["shape"] == "(B, T, 1)"
    assert by_name["decoder.1.cross_norm.normalized"]["shape"] == "(B, T, 16)"
    assert by_name["decoder.0.attn.q_pre"]["shape"] == "(B, 2, T, 8)" and by_name["decoder.0.attn.q_pre"]["heads"]
    assert by_name["encoder.1.ffn.pre"]["shape"] == "(B, T, 32)"
    text = attnlab("sites", str(run), "--match", "*.cross.z")
    assert text.returncode == 0 and text.stdout.split() == [
        "decoder.0.cross.z", "(B,", "2,", "T,", "8)", "heads", "of", "cross",
        "decoder.1.cross.z", "(B,", "2,", "T,", "8)", "heads", "of", "cross",
    ]  # fmt: skip


def test_a_match_that_finds_nothing_is_one_error_line(run):
    result = attnlab("sites", str(run), "--match", "encoder.0.atn.z")
    assert result.returncode == 2
    assert result.stderr.startswith("error: --match: site 'encoder.0.atn.z': no such site in this model; did you mean")
    assert result.stderr.count("\n") == 1
