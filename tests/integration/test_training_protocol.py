"""The paper's protocol in a run: early stop, model selection, the oracle report, fresh examples, MSE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from attnlab.errors import ConfigError
from attnlab.experiment import ExperimentConfig
from attnlab.run.directory import RunDir
from attnlab.run.storage import load_tensors
from attnlab.training import trainer as trainer_module
from attnlab.training.selection import ORACLE_LABEL, Selection
from attnlab.training.trainer import train

BASE = {
    "task": {
        "name": "parity",
        "max_train_length": 8,
        "train_size": 128,
        "valid_size": 32,
        "test_size": 32,
        "length_generalisation_size": 16,
        "eval_lengths": [[9, 12]],
    },
    "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.1},
    "train": {
        "steps": 12,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup": 4,
        "log_every": 1,
        "eval_every": 3,
        "checkpoint_every": 5,
        "eval_batch_size": 64,
    },
}


def _experiment(task=None, **train_changes) -> ExperimentConfig:
    return ExperimentConfig.from_dict(
        {**BASE, "task": {**BASE["task"], **(task or {})}, "train": {**BASE["train"], **train_changes}}
    )


def _records(run: Path, split: str) -> dict[int, dict]:
    """Step -> the last record of ``split`` at that step."""
    return {r["step"]: r for r in RunDir.open(run).read_metrics() if r.get("split") == split}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_tensors(run / "model.safetensors")[0]


def test_the_run_stops_at_the_first_evaluation_reaching_the_mean_accuracy_and_stays_stopped(tmp_path):
    """Chance accuracy (about 0.5) is above 0.01: the run stops at its first evaluation (step 3),
    records why, and a resume does not train on."""
    result = train(_experiment(stop_at_accuracy=0.01), tmp_path / "run", progress=False)
    assert result.step == 3
    records = RunDir.open(tmp_path / "run").read_metrics()
    stop = next(r for r in records if r.get("stopped_early"))
    assert stop["step"] == 3 and stop["stop_at_accuracy"] == 0.01
    assert stop["stop_splits"] == "valid, length_9_12"
    during = [r["accuracy"] for r in records if r.get("step") == 3 and r.get("split") in ("valid", "length_9_12")]
    assert stop["mean_accuracy"] == pytest.approx(sum(during[:2]) / 2)
    assert max(r["step"] for r in records if "split" not in r and "loss" in r) == 3  # no step after the stop
    assert train(_experiment(stop_at_accuracy=0.01), tmp_path / "run", resume=True, progress=False).step == 3


def test_an_unreachable_stop_trains_every_step(tmp_path):
    assert train(_experiment(stop_at_accuracy=1.0, eval_every=4), tmp_path / "run", progress=False).step == 12


def test_best_valid_scores_the_selected_weights_and_the_checkpoint_keeps_the_last(tmp_path, monkeypatch):
    """With the selection fixed at step 6, the final valid evaluation is that of step 6's weights
    (the same loss to the bit), and model.safetensors holds the last weights, as with select = last."""
    train(_experiment(select="last"), tmp_path / "last", progress=False)
    assert not (tmp_path / "last" / "oracle.json").exists()  # no oracle unless asked for
    assert sorted(_records(tmp_path / "last", "length_9_12")) == [12]  # ... and the bins only at the end
    monkeypatch.setattr(trainer_module, "select", lambda mode, history, last: Selection(mode, 6, "fixed"))
    train(_experiment(select="best_valid"), tmp_path / "best", progress=False)
    valid = _records(tmp_path / "best", "valid")
    assert valid[12]["selected_step"] == 6 and valid[12]["select"] == "best_valid"
    assert valid[12]["loss"] == valid[6]["loss"] and valid[12]["accuracy"] == valid[6]["accuracy"]
    assert valid[12]["loss"] != _records(tmp_path / "last", "valid")[12]["loss"]
    assert _records(tmp_path / "best", "length_9_12")[12]["selected_step"] == 6
    last, best = _weights(tmp_path / "last"), _weights(tmp_path / "best")
    assert all(torch.equal(last[name], best[name]) for name in last)


def test_best_valid_takes_the_best_validation_of_the_run(tmp_path):
    train(_experiment(select="best_valid", lr=3e-2), tmp_path / "run", progress=False)
    valid = _records(tmp_path / "run", "valid")
    during = {step: r for step, r in valid.items() if step < 12}
    chosen = valid[12]["selected_step"]
    if chosen < 12:  # the last step's own validation is a candidate too, scored without a record
        best = max(r["accuracy"] for r in during.values())
        assert during[chosen]["accuracy"] == best == valid[12]["accuracy"]


def test_the_oracle_is_the_best_bin_accuracy_over_the_evaluations_and_labelled(tmp_path):
    train(_experiment(oracle=True, eval_every=4), tmp_path / "run", progress=False)
    bins = _records(tmp_path / "run", "length_9_12")
    assert sorted(bins) == [4, 8, 12]  # every evaluation scores the bin, and the final one
    final = bins[12]
    assert final["oracle_accuracy"] == max(r["accuracy"] for r in bins.values())
    assert bins[final["oracle_step"]]["accuracy"] == final["oracle_accuracy"]
    assert final["oracle_selected_on"] == ORACLE_LABEL
    report = json.loads((tmp_path / "run" / "oracle.json").read_text())
    assert report["selected_on"] == "selected on the test bins"
    assert report["bins"]["length_9_12"] == {"accuracy": final["oracle_accuracy"], "step": final["oracle_step"]}
    assert report["steps"] == [4, 8, 12]
    assert "oracle_accuracy" not in _records(tmp_path / "run", "valid")[12]  # bins only, never the headline


def test_fresh_examples_resume_bit_equal_and_differ_from_the_fixed_set(tmp_path, monkeypatch):
    fresh = {"fresh_examples": True}
    straight = train(_experiment(task=fresh, eval_every=0), tmp_path / "straight", progress=False)
    fixed = train(_experiment(eval_every=0), tmp_path / "fixed", progress=False)
    assert straight.losses != fixed.losses

    real_step = trainer_module._Trainer._train_step
    calls = {"n": 0}

    def crashing_step(self):
        calls["n"] += 1
        if calls["n"] == 8:  # after the checkpoint at step 5
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer_module._Trainer, "_train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(_experiment(task=fresh, eval_every=0), tmp_path / "resumed", progress=False)
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", real_step)
    resumed = train(_experiment(task=fresh, eval_every=0), tmp_path / "resumed", resume=True, progress=False)
    assert resumed.losses == straight.losses[5:]  # bit for bit
    a, b = _weights(tmp_path / "straight"), _weights(tmp_path / "resumed")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_mse_is_refused_for_a_softmax_task_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match=r"^train\.loss: 'mse' applies to the per-symbol sigmoids"):
        train(_experiment(loss="mse"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_mse_trains_next_char_dyck(tmp_path):
    task = {
        "name": "dyck1",
        "formulation": "next_char",
        "max_train_length": 12,
        "eval_lengths": [[13, 16]],
        "sampler": "pcfg",
        "distinct": True,
        "train_size": 100,
        "valid_size": 16,
        "test_size": 16,
        "length_generalisation_size": 16,
    }
    experiment = ExperimentConfig.from_dict(
        {
            "task": task,
            "model": {"kind": "decoder_only", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
            "train": {"steps": 30, "batch_size": 16, "lr": 1e-2, "warmup": 5, "log_every": 10, "loss": "mse"},
        }
    )
    result = train(experiment, tmp_path / "run", progress=False)
    assert result.losses[-1] < result.losses[0]
