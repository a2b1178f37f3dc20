"""Training hygiene: the logged loss is the interval's mean, a classifier logs examples/s, checkpoints
record their validation (``best`` survives pruning and is the one chosen), and every final
evaluation says whether the model fit its training split."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from attnlab.errors import UsageError
from attnlab.evaluation.fit import TRAINED_THRESHOLD, fit_sample, training_fit
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run
from attnlab.tasks.registry import build_task
from attnlab.training.data import BatchStream
from attnlab.training.distributed import DistInfo
from attnlab.training.trainer import train
from tests.tiny_run import tiny_experiment

DYCK = {
    "name": "dyck1",
    "max_train_length": 8,
    "train_size": 32,
    "valid_size": 16,
    "test_size": 16,
    "length_generalisation_size": 4,
}
CLASSIFIER = {"kind": "encoder_classifier", "layers": 1, "d_model": 32, "heads": 2, "d_ff": 64, "dropout": 0.0}
pytestmark = pytest.mark.filterwarnings("ignore::attnlab.errors.AttnlabWarning")  # splits this small are warned about


def _classifier(**train_options) -> ExperimentConfig:
    options = {"batch_size": 32, "lr": 1e-2, "warmup": 5, "schedule": "constant", "threads": 1, **train_options}
    return ExperimentConfig.from_dict({"task": DYCK, "model": CLASSIFIER, "train": options})


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory) -> tuple[Path, list[float]]:
    """A 6-step language model logged every 3 steps, with a checkpoint after every step."""
    folder = tmp_path_factory.mktemp("lm")
    experiment = tiny_experiment(folder, steps=6)
    settings = dict(log_every=3, checkpoint_every=1, keep_checkpoints=10, threads=1)
    experiment = dataclasses.replace(experiment, train=dataclasses.replace(experiment.train, **settings))
    result = train(experiment, folder / "run", progress=False)
    return folder / "run", result.losses


def _step_loss(run: Path, step: int) -> float:
    """The loss of training step ``step`` computed here: the weights after step - 1 (its
    checkpoint) on the step-th batch of the stream, mean cross-entropy over the real target tokens."""
    loaded = open_run(run, checkpoint=f"step-{step - 1}")
    cfg = loaded.experiment.train
    task = loaded.task
    stream = BatchStream(
        task.split("train"),
        cfg.batch_size,
        pad_id=task.pad_id,
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        seed=cfg.seed,
        max_length=loaded.model.config.max_len,
        truncate=False,
        dist=DistInfo(),
    )
    for _ in range(step):
        batch = stream.next()
    with torch.no_grad():
        logits = loaded.model.double()(batch.tgt_in)
    real = batch.tgt_is_token
    return float(F.cross_entropy(logits[real], batch.tgt_out[real]))


def test_logged_loss_is_the_mean_over_the_logging_interval(lm_run):
    run, losses = lm_run
    steps = [r for r in RunDir.open(run).read_metrics() if "split" not in r and "loss" in r]
    assert [r["step"] for r in steps] == [3, 6]
    independent = {step: _step_loss(run, step) for step in range(2, 7)}
    for step, loss in independent.items():
        assert losses[step - 1] == pytest.approx(loss, rel=1e-5)
    first = (losses[0] + independent[2] + independent[3]) / 3
    second = sum(independent[s] for s in (4, 5, 6)) / 3
    assert steps[0]["loss"] == pytest.approx(first, rel=1e-5)
    assert steps[1]["loss"] == pytest.approx(second, rel=1e-5)
    assert steps[1]["loss"] != pytest.approx(losses[-1], rel=1e-6)  # not the last batch's loss
    assert all("tokens_per_s" in r and "examples_per_s" not in r for r in steps)


def test_a_classifier_logs_examples_per_second(tmp_path):
    train(_classifier(steps=2, log_every=1), tmp_path / "run", progress=False)
    steps = [r for r in RunDir.open(tmp_path / "run").read_metrics() if "split" not in r and "loss" in r]
    assert len(steps) == 2
    assert all(r["examples_per_s"] > 0 and "tokens_per_s" not in r for r in steps)
    assert all({"step", "loss", "lr", "epoch"} <= set(r) for r in steps)


# ---- checkpoints and their validation ------------------------------------------------------------


def test_best_checkpoint_is_the_best_recorded_validation_and_its_weights_load(tmp_path):
    experiment = _classifier(steps=8, eval_every=1, checkpoint_every=1, keep_checkpoints=20)
    train(experiment, tmp_path / "run", progress=False)
    run = RunDir.open(tmp_path / "run")
    evaluations = [r for r in run.read_metrics() if r.get("split") == "valid"]
    for files in run.checkpoints():  # each checkpoint records the evaluation of its step
        record = run.checkpoint_validation(files)
        logged = [r for r in evaluations if r["step"] == files.step][-1]
        assert (record["accuracy"], record["loss"]) == (logged["accuracy"], logged["loss"])
    by_step = {r["step"]: r for r in evaluations}  # the final evaluation of step 8 overrides the periodic one
    expected = min(by_step.values(), key=lambda r: (-r["accuracy"], r["loss"], r["step"]))["step"]
    loaded = open_run(tmp_path / "run", checkpoint="best")
    assert loaded.checkpoint.step == expected
    stored = load_file(run.path / "checkpoints" / f"step-{expected:08d}" / "model.safetensors")
    state = loaded.model.state_dict()
    assert all(torch.equal(state[name], tensor) for name, tensor in stored.items())
    assert open_run(tmp_path / "run", checkpoint="last").checkpoint.step == 8
    assert open_run(tmp_path / "run", checkpoint="step-00000003").checkpoint.step == 3


def _write(run: RunDir, model: torch.nn.Module, step: int, accuracy: float | None, loss: float = 1.0) -> None:
    state = (
        {} if accuracy is None else {"validation": {"step": step, "split": "valid", "accuracy": accuracy, "loss": loss}}
    )
    run.write_checkpoint(step, model, {"x": torch.zeros(1)}, state, keep=1)


def test_pruning_old_checkpoints_keeps_the_best(tmp_path):
    run = RunDir.create(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    _write(run, model, 1, 0.5)
    _write(run, model, 2, 0.9, loss=0.4)
    _write(run, model, 3, 0.7)
    _write(run, model, 4, 0.9, loss=0.6)  # as accurate as step 2, higher loss
    _write(run, model, 5, None)  # not evaluated
    assert [files.step for files in run.checkpoints()] == [2, 5]
    assert run.best_checkpoint().step == 2
    _write(run, model, 6, 0.95)
    assert [files.step for files in run.checkpoints()] == [6]  # the new best is also the latest


def test_a_checkpoint_that_is_not_there_is_named_with_the_available_ones(tmp_path):
    run = RunDir.create(tmp_path / "run")
    model = torch.nn.Linear(2, 2)
    _write(run, model, 1, None)
    with pytest.raises(UsageError, match=r"--checkpoint best: .* records a validation.*available: last, best, step-1"):
        run.choose_checkpoint("best")
    with pytest.raises(UsageError, match=r"--checkpoint: .* has no checkpoint step-7; available: last, best, step-1$"):
        run.choose_checkpoint("step-7")
    with pytest.raises(UsageError, match=r"--checkpoint: 'latest' is not last, best or step-N"):
        run.choose_checkpoint("latest")


# ---- trained / not trained -----------------------------------------------------------------------


def _brute_force_train_accuracy(model: torch.nn.Module, task) -> float:  # noqa: ANN001
    """The share of training strings classified right, one string at a time (no batching)."""
    right = 0
    examples = task.split("train")
    with torch.no_grad():
        for example in examples:
            logits = model.eval()(torch.tensor([list(example.source)]))
            right += int(logits.argmax(-1).item() == example.label)
    return right / len(examples)


def test_trained_flag_of_a_run_that_fits_and_of_an_untrained_model(tmp_path):
    experiment = _classifier(steps=100, log_every=0)
    final = train(experiment, tmp_path / "run", progress=False).final_metrics
    loaded = open_run(tmp_path / "run")
    assert final["trained"] is True and final["trained_threshold"] == TRAINED_THRESHOLD
    assert final["train_accuracy"] == pytest.approx(_brute_force_train_accuracy(loaded.model, loaded.task))
    assert final["train_examples"] == DYCK["train_size"]

    task, _ = build_task(experiment.task)
    torch.manual_seed(1)
    untrained = model_for_task(experiment, task)
    fit = training_fit(untrained, task, kind="encoder_classifier")
    assert fit["train_accuracy"] == pytest.approx(_brute_force_train_accuracy(untrained, task))
    assert fit["trained"] is (fit["train_accuracy"] >= TRAINED_THRESHOLD)
    assert fit["trained"] is False


def test_fit_sample_spreads_over_the_split():
    assert fit_sample(list(range(10)), 4) == [0, 2, 5, 7]
    assert fit_sample(list(range(3)), 4) == [0, 1, 2]
    assert fit_sample([], 4) == []


def test_eval_command_scores_the_chosen_checkpoint_and_says_whether_it_trained(tmp_path, capsys):
    from attnlab.cli import main
    from attnlab.evaluation import evaluate

    train(_classifier(steps=4, eval_every=2, checkpoint_every=2, keep_checkpoints=5), tmp_path / "run", progress=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(tmp_path / "run"), "--checkpoint", "step-2", "--json", "--no-progress"])
    out = json.loads(capsys.readouterr().out)
    assert exit_info.value.code in (0, None)
    loaded = open_run(tmp_path / "run", checkpoint="step-2")
    expected = evaluate(loaded.model, loaded.task, "test", kind="encoder_classifier")
    assert out["checkpoint"] == "step-2" and out["accuracy"] == pytest.approx(expected["accuracy"])
    fit = training_fit(loaded.model, loaded.task, kind="encoder_classifier")
    assert {k: out[k] for k in fit} == pytest.approx(fit)
    with pytest.raises(SystemExit):
        main(["eval", str(tmp_path / "run"), "--checkpoint", "best", "--no-progress"])
    assert "\ntrained: " in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(tmp_path / "run"), "--checkpoint", "step-3", "--no-progress"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert (
        err
        == f"error: --checkpoint: {tmp_path / 'run'} has no checkpoint step-3; available: last, best, step-2, step-4\n"
    )
