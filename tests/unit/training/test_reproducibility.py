"""train.threads is applied and recorded, every checkpoint records its platform, and a resume on
another thread count, CPU model or torch version warns once; config.json holds every value."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest
import torch

from attnlab.errors import AttnlabWarning
from attnlab.experiment import TASK_DECIDES, ExperimentConfig, TrainConfig
from attnlab.nn import MODELS
from attnlab.run.directory import RunDir
from attnlab.tasks.registry import task_options
from attnlab.training import trainer as trainer_module
from attnlab.training.reproducibility import platform_differences, platform_record, warn_if_platform_differs
from attnlab.training.trainer import train

TINY = {
    "task": {
        "name": "copy",
        "max_train_length": 3,
        "train_size": 16,
        "valid_size": 4,
        "test_size": 4,
        "length_generalisation_size": 2,
    },
    "model": {"kind": "encoder_decoder", "layers": 1, "d_model": 8, "heads": 2, "d_ff": 8},
    "train": {"steps": 2, "batch_size": 4, "log_every": 1},
}
OTHER = 2 if torch.get_num_threads() == 1 else 1
"""A thread count other than this process's."""


def _experiment(**train_changes) -> ExperimentConfig:
    return ExperimentConfig.from_dict({**TINY, "train": {**TINY["train"], **train_changes}})


def _trainer_state(run: Path) -> dict:
    return json.loads(RunDir.open(run).latest_checkpoint().trainer_json.read_text())


def test_threads_are_applied_while_training_and_recorded(tmp_path, monkeypatch):
    seen = []
    step = trainer_module._Trainer._train_step
    spy = lambda self: seen.append(torch.get_num_threads()) or step(self)  # noqa: E731
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", spy)
    before = torch.get_num_threads()
    train(_experiment(threads=OTHER), tmp_path / "run", progress=False)
    assert seen == [OTHER, OTHER]
    assert torch.get_num_threads() == before  # restored for the caller
    assert json.loads((tmp_path / "run" / "config.json").read_text())["train"]["threads"] == OTHER
    assert _trainer_state(tmp_path / "run")["platform"] == platform_record(OTHER)
    assert set(platform_record(OTHER)) == {"threads", "cpu", "torch", "python"}
    assert platform_record(OTHER)["torch"] == torch.__version__


def test_threads_0_is_resolved_to_the_process_count_in_config_json(tmp_path):
    train(_experiment(threads=0), tmp_path / "run", progress=False)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["train"]["threads"] == torch.get_num_threads() >= 1


def test_config_json_holds_every_resolved_value(tmp_path):
    train(_experiment(), tmp_path / "run", progress=False)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    model_fields = set(MODELS["encoder_decoder"][0].field_names()) - set(TASK_DECIDES)
    assert set(config["model"]) == model_fields | {"kind"}
    assert config["model"]["max_len"] == 512 and config["model"]["straight_through"] is False
    assert set(config["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert set(config["task"]) == set(task_options("copy")) | {"name"}
    assert ExperimentConfig.from_dict(config) == _experiment(threads=config["train"]["threads"])


def test_resume_at_another_thread_count_warns_once(tmp_path):
    run = tmp_path / "run"
    train(_experiment(threads=1), run, progress=False)
    with pytest.warns(AttnlabWarning) as caught:
        train(_experiment(threads=2, steps=3), run, resume=True, progress=False)
    messages = [str(w.message) for w in caught if issubclass(w.category, AttnlabWarning)]
    assert len(messages) == 1
    assert "threads 1 -> 2" in messages[0] and "step 2" in messages[0] and "bit" in messages[0]
    assert _trainer_state(run)["platform"]["threads"] == 2  # the new checkpoint records the new count
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)  # same count as the checkpoint: silent
        train(_experiment(threads=2, steps=4), run, resume=True, progress=False)


def test_another_cpu_or_torch_version_is_named():
    here = platform_record(2)
    recorded = {**here, "cpu": "Some Other CPU", "torch": "1.0.0", "python": "3.0.0"}
    assert platform_differences(recorded, here) == [
        f"CPU Some Other CPU -> {here['cpu']}",
        f"torch 1.0.0 -> {torch.__version__}",
    ]
    with pytest.warns(AttnlabWarning, match=r"RUN/checkpoints/step-00000007 was trained up to step 7 .*CPU Some"):
        warn_if_platform_differs(recorded, here, where="RUN/checkpoints/step-00000007", step=7)


def test_a_checkpoint_without_a_record_is_not_compared():
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        warn_if_platform_differs(None, platform_record(2), where="RUN", step=1)
        warn_if_platform_differs({"threads": 2}, platform_record(2), where="RUN", step=1)  # fields missing: skipped


@pytest.mark.parametrize(
    "threads,message", [(-1, "train.threads: must be >= 0, got -1"), (10**6, "train.threads: must be <= 1024")]
)
def test_a_bad_thread_count_is_a_config_error(threads, message):
    from attnlab.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _experiment(threads=threads)
