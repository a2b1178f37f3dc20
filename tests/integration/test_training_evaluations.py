"""What training evaluates beside its loss: randomized evaluation positions that never move the
training RNG (resume stays bit-equal), and the end-of-training records of length and depth bins,
the horizon over the length bins and the training split's depth range."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.errors import ConfigError
from attnlab.evaluation.evaluate import evaluate
from attnlab.evaluation.horizon import chained_horizon
from attnlab.experiment import ExperimentConfig
from attnlab.kernels import linear as linear_module
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run
from attnlab.run.storage import load_tensors
from attnlab.tasks.formal_dyck import bracket_depth
from attnlab.tasks.registry import build_task
from attnlab.training import trainer as trainer_module
from attnlab.training.trainer import train

RANDOMIZED = {
    "task": {"name": "parity", "max_train_length": 8, "train_size": 128, "valid_size": 32, "test_size": 16,
             "length_generalisation_size": 16},
    "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.1,
              "randomized_positions": 32, "max_len": 32},
    "train": {"steps": 6, "batch_size": 16, "lr": 3e-3, "warmup": 2, "log_every": 1, "eval_every": 3,
              "checkpoint_every": 3},
}  # fmt: skip


def _experiment(section: dict, **train_changes) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**section, "train": {**section["train"], **train_changes}})


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_tensors(run / "model.safetensors")[0]


def _evaluations(run: Path) -> dict[tuple[int, str], dict]:
    return {(r["step"], r["split"]): r for r in RunDir.open(run).read_metrics() if "split" in r}


def test_randomized_evaluation_positions_change_the_evaluations_only_and_resume_stays_bit_equal(tmp_path, monkeypatch):
    """Training draws its randomized positions (and dropout) from torch's global generator; the
    evaluations every 3 steps draw theirs from their own. So: the same weights with evaluations at
    0..T-1 or randomized, other evaluation results, and a run interrupted after its checkpoint at
    step 3 and resumed ends with the weights and evaluations of the uninterrupted one, bit for bit."""
    straight = train(_experiment(RANDOMIZED, eval_positions="randomized"), tmp_path / "straight", progress=False)
    plain = train(_experiment(RANDOMIZED), tmp_path / "plain", progress=False)
    assert straight.losses == plain.losses
    for name, tensor in _weights(tmp_path / "straight").items():
        assert torch.equal(tensor, _weights(tmp_path / "plain")[name]), name
    randomized, consecutive = _evaluations(tmp_path / "straight"), _evaluations(tmp_path / "plain")
    assert randomized[(3, "valid")]["positions"] == "randomized" and "positions" not in consecutive[(3, "valid")]
    assert randomized[(3, "valid")]["loss"] != consecutive[(3, "valid")]["loss"]

    real_step = trainer_module._Trainer._train_step
    calls = {"n": 0}

    def interrupted_step(self):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 5:  # after the evaluation and checkpoint at step 3
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer_module._Trainer, "_train_step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        train(_experiment(RANDOMIZED, eval_positions="randomized"), tmp_path / "resumed", progress=False)
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", real_step)
    resumed = train(_experiment(RANDOMIZED, eval_positions="randomized"), tmp_path / "resumed", resume=True,
                    progress=False)  # fmt: skip
    assert resumed.losses == straight.losses[3:]
    for name, tensor in _weights(tmp_path / "straight").items():
        assert torch.equal(tensor, _weights(tmp_path / "resumed")[name]), name
    assert _evaluations(tmp_path / "resumed") == randomized


def test_positions_as_trained_follow_the_model(tmp_path):
    """``as_trained``: a model trained with randomized positions is evaluated with them (the same
    evaluations as ``randomized``), one trained without at 0..T-1 (as ``consecutive``): one config
    serves a grid over model.randomized_positions."""
    shorter = {**RANDOMIZED, "train": {**RANDOMIZED["train"], "steps": 3}}
    plain_model = {**shorter, "model": {**shorter["model"], "randomized_positions": 0}}
    runs = {
        name: _evaluations(train(_experiment(section, eval_positions=mode), tmp_path / name, progress=False) and
                           tmp_path / name)
        for name, section, mode in [("as_trained", shorter, "as_trained"), ("randomized", shorter, "randomized"),
                                    ("plain_as_trained", plain_model, "as_trained"),
                                    ("plain", plain_model, "consecutive")]
    }  # fmt: skip
    assert runs["as_trained"] == runs["randomized"]
    assert runs["as_trained"][(3, "valid")]["positions"] == "randomized"
    assert runs["plain_as_trained"] == runs["plain"]
    assert "positions" not in runs["plain"][(3, "valid")]


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"randomized_positions": 0}, r"train.eval_positions: \"randomized\" draws positions as training does"),
    ],
)
def test_randomized_evaluation_positions_are_refused_where_they_cannot_apply(model, message):
    section = {**RANDOMIZED, "model": {**RANDOMIZED["model"], **model}}
    with pytest.raises(ConfigError, match=f"^{message}"):
        _experiment(section, eval_positions="randomized")
    with pytest.raises(
        ConfigError, match=r"^train.eval_positions: unknown 'shuffled'; allowed: consecutive, randomized, as_trained"
    ):
        _experiment(RANDOMIZED, eval_positions="shuffled")


DYCK = {
    "task": {"name": "dyck1", "formulation": "next_char", "max_train_length": 10, "train_size": 128,
             "valid_size": 16, "test_size": 16, "length_generalisation_size": 24,
             "eval_lengths": [[11, 14], [15, 18], [21, 24]], "eval_depths": [[1, 3], [4, 9]]},
    "model": {"kind": "decoder_only", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
    "train": {"steps": 2, "batch_size": 16, "log_every": 1},
}  # fmt: skip


def test_the_end_of_training_records_bins_horizons_and_the_training_depth_range(tmp_path):
    experiment = _experiment(DYCK)
    train(experiment, tmp_path / "run", progress=False)
    records = _evaluations(tmp_path / "run")
    task, _ = build_task(experiment.task)
    depths = [bracket_depth(task.string_of(e)) for e in task.split("train")]
    assert (records[(2, "train")]["depth_min"], records[(2, "train")]["depth_max"]) == (min(depths), max(depths))
    bins = [records[(2, name)] for name in ("length_11_14", "length_15_18", "length_21_24")]
    assert [b["absent_lengths"] for b in bins] == [[11, 13], [15, 17], [21, 23]]
    overall = records[(2, "length_bins")]
    assert overall["horizon"] == chained_horizon(bins) and overall["length_range"] == [11, 24]
    assert overall["horizon_threshold"] == 0.95
    for name, (low, high) in (("depth_1_3", (1, 3)), ("depth_4_9", (4, 9))):
        assert low <= records[(2, name)]["depth_min"] <= records[(2, name)]["depth_max"] <= high
        assert records[(2, name)]["length_range"] == [11, 24]


@pytest.mark.parametrize("final_splits", [["test", "length_generalisation"], ["test"]])
def test_the_horizon_over_bins_past_the_first_unseen_length_starts_from_length_generalisation(tmp_path, final_splits):
    """Trained on 1..10, binned at 21..24: the chain starts at 11 with the length_generalisation
    split (11..20) where it was scored, and claims no more than 10 where it was not."""
    task = {key: value for key, value in DYCK["task"].items() if key != "eval_depths"}
    section = {**DYCK, "task": {**task, "eval_lengths": [[21, 24]]}}
    train(_experiment(section, final_splits=final_splits), tmp_path / "run", progress=False)
    records = _evaluations(tmp_path / "run")
    overall, last_bin = records[(2, "length_bins")], records[(2, "length_21_24")]
    if "length_generalisation" in final_splits:
        first = records[(2, "length_generalisation")]
        assert first["length_range"] == [11, 20] and overall["length_range"] == [11, 24]
        assert overall["horizon"] == chained_horizon([first, last_bin])
    else:
        assert overall["horizon"] == 10 and overall["length_range"] == [21, 24]


@pytest.mark.skipif(not linear_module.onednn_available(), reason="oneDNN is not built into this torch")
def test_evaluations_during_training_score_the_current_weights(tmp_path, monkeypatch):
    """The kernel choice that once made evaluations score stale weights: training's passes on aten,
    evaluation's on oneDNN, whose packed copies outlived fused Adam's in-place steps. Each
    evaluation during training must equal evaluating that step's saved weights afresh."""

    measured = linear_module.calibration.chosen

    def evaluate_on_onednn_train_on_aten(key):  # noqa: ANN001, ANN202
        if key[0] != "linear" or key[1] < linear_module.MIN_ONEDNN_ROWS:
            return measured(key)
        return "aten" if key[4] else "onednn"  # key: ("linear", rows, W's shape, no bias, gradient)

    monkeypatch.setattr(linear_module.calibration, "chosen", evaluate_on_onednn_train_on_aten)
    section = {**DYCK, "train": {**DYCK["train"], "steps": 9, "eval_every": 3, "checkpoint_every": 3,
                                 "keep_checkpoints": 3}}  # fmt: skip
    train(_experiment(section), tmp_path / "run", progress=False)
    loaded = open_run(tmp_path / "run")
    records = _evaluations(tmp_path / "run")
    for step in (3, 6, 9):
        weights = load_tensors(tmp_path / "run" / "checkpoints" / f"step-{step:08d}" / "model.safetensors")[0]
        loaded.model.load_state_dict(weights)
        afresh = evaluate(loaded.model, loaded.task, "valid", kind="decoder_only")
        assert records[(step, "valid")]["loss"] == pytest.approx(afresh["loss"], rel=1e-5), step
