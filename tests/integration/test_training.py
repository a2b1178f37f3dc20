"""Training runs: exact resume, NaN stop, SIGKILL while checkpointing, two processes = one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from attnlab.errors import AttnlabError, CheckpointError
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.run.directory import RunDir
from attnlab.run.storage import load_tensors
from attnlab.run.verification import verify_run
from attnlab.run.weights import load_weights_into
from attnlab.tasks.registry import build_task
from attnlab.training import trainer as trainer_module
from attnlab.training.schedule import multiplier
from attnlab.training.trainer import TrainingDiverged, train

BASE = {
    "task": {
        "name": "parity",
        "max_train_length": 8,
        "train_size": 256,
        "valid_size": 32,
        "test_size": 32,
        "length_generalisation_size": 16,
    },
    "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.1},
    "train": {
        "steps": 12,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup": 4,
        "log_every": 1,
        "eval_every": 0,
        "checkpoint_every": 5,
        "eval_batch_size": 64,
    },
}


def _experiment(**train_changes) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**BASE, "train": {**BASE["train"], **train_changes}})


def _losses(run: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in RunDir.open(run).read_metrics() if "split" not in r}


@pytest.mark.parametrize("schedule", ["noam", "cosine"])
def test_logged_learning_rate_is_the_one_each_step_used(tmp_path, schedule):
    """metrics.jsonl's lr at step k is the multiplier of step k (1-based), the rate of the k-th update."""
    train(_experiment(schedule=schedule, checkpoint_every=0), tmp_path / "run", progress=False)
    logged = {r["step"]: r["lr"] for r in RunDir.open(tmp_path / "run").read_metrics() if "split" not in r}
    assert sorted(logged) == list(range(1, 13))
    for step, lr in logged.items():
        assert lr == pytest.approx(3e-3 * multiplier(schedule, step, warmup=4, total=12), rel=1e-12)
    assert max(logged, key=logged.get) == 4  # the peak is at step = warmup, as in Vaswani §5.3


def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path, monkeypatch):
    straight = train(_experiment(), tmp_path / "straight", progress=False)
    assert straight.step == 12

    real_step = trainer_module._Trainer._train_step
    calls = {"n": 0}

    def crashing_step(self):
        calls["n"] += 1
        if calls["n"] == 8:  # after the checkpoint at step 5, before the next one
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(trainer_module._Trainer, "_train_step", crashing_step)
    with pytest.raises(KeyboardInterrupt):
        train(_experiment(), tmp_path / "resumed", progress=False)
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", real_step)
    assert RunDir.open(tmp_path / "resumed").latest_checkpoint().step == 5
    resumed = train(_experiment(), tmp_path / "resumed", resume=True, progress=False)
    assert resumed.losses == straight.losses[5:]  # bit for bit, dropout included
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")  # no step logged twice
    # Every final weight is identical. (Not the file bytes: safetensors writes its metadata keys in
    # hash-map order, which varies between processes.)
    straight_weights, _ = load_tensors(tmp_path / "straight" / "model.safetensors")
    resumed_weights, _ = load_tensors(tmp_path / "resumed" / "model.safetensors")
    assert straight_weights.keys() == resumed_weights.keys()
    for name, tensor in straight_weights.items():
        assert torch.equal(tensor, resumed_weights[name]), name


def _poison_loss(monkeypatch, call: int, value: float):  # noqa: ANN001, ANN202
    """Make the classifier objective's ``call``-th loss ``value`` (nan or inf); returns the real one."""
    real = trainer_module.OBJECTIVES["encoder_classifier"]
    seen = {"n": 0}

    def poisoned(model, batch, head_mask, pad_id, smoothing, **options):
        seen["n"] += 1
        parts = real(model, batch, head_mask, pad_id, smoothing, **options)
        return parts._replace(total=parts.total * value) if seen["n"] == call else parts

    monkeypatch.setitem(trainer_module.OBJECTIVES, "encoder_classifier", poisoned)
    return real


def test_nan_loss_stops_naming_the_step_and_keeps_the_checkpoint(tmp_path, monkeypatch):
    _poison_loss(monkeypatch, 7, float("nan"))
    with pytest.raises(TrainingDiverged, match=r"the loss became nan at step 7; the last good checkpoint \(step 5\)"):
        train(_experiment(), tmp_path / "run", progress=False)
    files = RunDir.open(tmp_path / "run").latest_checkpoint()
    assert files.step == 5
    model = model_for_task(_experiment(), build_task(BASE["task"])[0])
    load_weights_into(model, files.model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_checkpoint_of_the_weights_that_diverged_is_not_called_good(tmp_path, monkeypatch):
    """The loss of step 7 is computed with the weights of step 6: with a checkpoint every step,
    the run points back to step 5's, and resumes from there."""
    real = _poison_loss(monkeypatch, 7, float("inf"))
    message = r"at step 7; the last good checkpoint \(step 5\) .* points back to it \(the one of step 6 holds"
    with pytest.raises(TrainingDiverged, match=message):
        train(_experiment(checkpoint_every=1), tmp_path / "run", progress=False)
    run = RunDir.open(tmp_path / "run")
    assert run.latest_checkpoint().step == 5
    assert (
        load_tensors(run.path / "model.safetensors")[0].keys() == load_tensors(run.latest_checkpoint().model)[0].keys()
    )
    for name, tensor in load_tensors(run.path / "model.safetensors")[0].items():
        assert torch.equal(tensor, load_tensors(run.latest_checkpoint().model)[0][name])
    monkeypatch.setitem(trainer_module.OBJECTIVES, "encoder_classifier", real)
    assert train(_experiment(checkpoint_every=1), run.path, resume=True, progress=False).step == 12


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    run = RunDir.create(tmp_path / "run")
    run.write_config(_experiment().to_dict())
    with pytest.raises(CheckpointError, match="has no checkpoint to resume from"):
        train(_experiment(), run.path, resume=True, progress=False)


def _cli(*args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "attnlab", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs
    )


def _write_config(path: Path, **train_changes) -> Path:
    import json

    train_section = {**BASE["train"], **train_changes}
    lines = []
    for section, values in (("task", BASE["task"]), ("model", BASE["model"]), ("train", train_section)):
        lines.append(f"[{section}]")
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_sigkill_while_checkpointing_always_leaves_a_loadable_checkpoint(tmp_path):
    """Kill -9 a run that checkpoints every step, at several points of its life."""
    config = _write_config(tmp_path / "c.toml", steps=100000, checkpoint_every=1, log_every=1)
    experiment = _experiment()
    killed_at = []
    for attempt, wait_steps in enumerate([1, 3, 6, 10]):
        run = tmp_path / f"run{attempt}"
        process = _cli("train", str(config), "--out", str(run), "--no-progress")
        deadline = time.time() + 120
        # Wait for the run to pass `wait_steps` checkpoints, then kill it after a short, varying delay,
        # mostly in the middle of writing the next checkpoint (it writes one every step).
        while time.time() < deadline:
            pointer = run / "checkpoint.json"
            try:
                if pointer.exists() and json.loads(pointer.read_text())["step"] >= wait_steps:
                    break
            except (ValueError, KeyError):
                pass
            time.sleep(0.01)
        time.sleep(0.007 * attempt)
        process.send_signal(signal.SIGKILL)
        process.wait()
        opened = RunDir.open(run)
        files = opened.latest_checkpoint()
        assert files is not None
        model = model_for_task(experiment, build_task(BASE["task"])[0])
        tensors, state = opened.read_trainer_state(files)
        assert state["step"] == files.step and "rng.torch" in tensors
        opened.load_checkpoint_weights(model, files)  # verified against the checkpoint's manifest
        opened.load_weights(model)  # model.safetensors (the checkpoint's before its first publication), verified
        report = verify_run(run)  # and every other file: the kill left a run that verifies
        assert report.ok and not report.warnings, report.to_dict()
        killed_at.append(files.step)
    assert len(set(killed_at)) > 1  # the kills landed at different points of the run


WORDPIECE_CORPUS = [
    f"{a} {b} {c}"
    for a in ("Tokenization", "splits", "first")
    for b in ("amazing tokens", "didn't split", "first steps")
    for c in ("on the mat.", "it's the first step.", "splitting")
] * 3
"""Words whose pieces HF's WordPiece trainer picks differently from call to call (merge ties)."""


def test_every_process_encodes_with_the_tokenizer_of_rank_0(tmp_path):
    """HF's WordPiece trainer can learn other pieces from the same corpus on every call; if each
    rank trained its own, rank 1 would feed other ids than rank 0 saved. One process given rank 0's
    saved tokenizer must then end with the weights of the two."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(WORDPIECE_CORPUS) + "\n")
    config = tmp_path / "lm.toml"
    config.write_text(
        f'[task]\nname = "lm"\ntrain_file = "{corpus}"\ntokenizer_kind = "wordpiece"\nvocab_size = 400\n'
        '[model]\nkind = "decoder_only"\nlayers = 1\nd_model = 16\nheads = 2\nd_ff = 32\ndropout = 0.0\n'
        "[train]\nsteps = 4\nbatch_size = 8\nlr = 3e-3\nwarmup = 2\nlog_every = 1\ncheckpoint_every = 0\n"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = _cli("train", str(config), "--out", str(tmp_path / "two"), "--nproc", "2", "--no-progress", env=env)
    assert two.wait(timeout=240) == 0, two.stderr.read()
    saved = tmp_path / "two" / "tokenizer.json"
    one = _cli(
        "train",
        str(config),
        "--out",
        str(tmp_path / "one"),
        "--no-progress",
        "--set",
        f'task.tokenizer="{saved}"',
        env=env,
    )
    assert one.wait(timeout=240) == 0, one.stderr.read()
    for step, loss in _losses(tmp_path / "one").items():
        assert loss == pytest.approx(_losses(tmp_path / "two")[step], abs=1e-5)


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_two_processes_equal_one_process_with_the_whole_batch(tmp_path, attention):
    changes = {"steps": 6, "checkpoint_every": 0, "log_every": 1}
    config = _write_config(tmp_path / "c.toml", **changes)
    overrides = ["--set", "model.dropout=0.0", "--set", f'model.attention="{attention}"']
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = _cli("train", str(config), "--out", str(tmp_path / "one"), "--no-progress", *overrides, env=env)
    two = _cli(
        "train", str(config), "--out", str(tmp_path / "two"), "--nproc", "2", "--no-progress", *overrides, env=env
    )
    for process in (one, two):
        _, err = process.communicate(timeout=240)
        assert process.returncode == 0, err
    experiment = ExperimentConfig.from_dict(RunDir.open(tmp_path / "one").read_config())
    task = build_task(experiment.task)[0]
    models = []
    for name in ("one", "two"):
        model = model_for_task(experiment, task)
        load_weights_into(model, tmp_path / name / "model.safetensors")
        models.append(model)
    # The key bias b_K adds q . b_K to every score of a row alike, which softmax ignores: its true
    # gradient is 0, and Adam scales the float noise that stands in for it into lr-sized steps. It
    # cannot change the function, so it is compared through the outputs below, not entry by entry.
    d = models[0].config.d_model
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters()):
        if name.endswith("self_attn.in_proj_bias"):
            a, b = torch.cat([a[:d], a[2 * d :]]), torch.cat([b[:d], b[2 * d :]])
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
    batch = torch.tensor([[3, 4, 4, 3, 2], [4, 3, 2, 0, 0]])
    torch.testing.assert_close(models[0].eval()(batch), models[1].eval()(batch), atol=1e-5, rtol=0)
    assert _losses(tmp_path / "one").keys() == _losses(tmp_path / "two").keys()
    for step, loss in _losses(tmp_path / "one").items():
        assert loss == pytest.approx(_losses(tmp_path / "two")[step], abs=1e-5)


def test_training_errors_are_attnlab_errors(tmp_path):
    with pytest.raises(AttnlabError, match="model.kind: task 'parity' trains a encoder_classifier model"):
        train(
            ExperimentConfig.from_dict({**BASE, "model": {**BASE["model"], "kind": "decoder_only"}}),
            tmp_path / "x",
            progress=False,
        )
