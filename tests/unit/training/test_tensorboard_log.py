"""train.log_to = ["jsonl", "tensorboard"]: TensorBoard event files, read back with TensorBoard's own reader.

Every scalar equals its metrics.jsonl value at the same step, an attention image exists at each
validation, a crashed session's events are flushed and hidden after the resume, bad ``log_to``
values are one-line ConfigErrors, and without "tensorboard" no event file is written.
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, EventAccumulator

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.errors import ConfigError
from attnlab.experiment import ExperimentConfig, load_experiment, model_for_task
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run, run_experiment
from attnlab.run.verification import verify_run
from attnlab.tasks.codec import TextCodec
from attnlab.tasks.registry import build_task
from attnlab.training import trainer as trainer_module
from attnlab.training.tensorboard_log import (
    TENSORBOARD_FOLDER,
    NoSink,
    TensorBoardSink,
    attention_sample,
    open_sink,
    sample_maps,
    scalars_of,
)
from attnlab.training.trainer import train

pytestmark = pytest.mark.filterwarnings("ignore::attnlab.errors.AttnlabWarning")  # splits this small are warned about

PARITY = {
    "name": "parity",
    "max_train_length": 6,
    "train_size": 48,
    "valid_size": 24,
    "test_size": 16,
    "length_generalisation_size": 16,
    "seed": 5,
}
CLASSIFIER = {"kind": "encoder_classifier", "layers": 2, "d_model": 8, "heads": 2, "d_ff": 16, "dropout": 0.0}
TRAIN = {
    "steps": 6,
    "batch_size": 8,
    "log_every": 1,
    "eval_every": 3,
    "checkpoint_every": 3,
    "threads": 1,
    "log_to": ["jsonl", "tensorboard"],
    "final_splits": ["length_generalisation"],
}


def _experiment(**train_changes) -> ExperimentConfig:
    return ExperimentConfig.from_dict({"task": PARITY, "model": CLASSIFIER, "train": {**TRAIN, **train_changes}})


def _events(run: Path) -> EventAccumulator:
    events = EventAccumulator(str(run / TENSORBOARD_FOLDER), size_guidance={SCALARS: 0, IMAGES: 0})  # keep all
    events.Reload()
    return events


def _scalars(events: EventAccumulator) -> dict[tuple[str, int], float]:
    found: dict[tuple[str, int], float] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert (tag, event.step) not in found, f"{tag} at step {event.step} twice"
            found[tag, event.step] = event.value
    return found


def _expected(run: Path) -> dict[tuple[str, int], float]:
    """What metrics.jsonl says, as TensorBoard keeps it (float32), keyed like TensorBoard's scalars."""
    expected = {}
    for record in RunDir.open(run).read_metrics():
        for tag, value in scalars_of(record).items():
            expected[tag, record["step"]] = float(np.float32(value))
    return expected


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tb") / "run"
    train(_experiment(), path, progress=False)
    return path


def test_every_scalar_equals_the_metrics_jsonl_record_of_its_step(run):
    found, expected = _scalars(_events(run)), _expected(run)
    assert found == expected  # the same tags at the same steps, the same values (float32)
    tags = {tag for tag, _ in found}
    for tag in ("train/loss", "train/lr", "train/examples_per_s", "valid/accuracy", "valid/loss"):
        assert tag in tags
    assert "length_generalisation/accuracy" in tags
    assert sorted(step for tag, step in found if tag == "train/loss") == [1, 2, 3, 4, 5, 6]
    assert sorted(step for tag, step in found if tag == "valid/accuracy") == [3, 6]


def test_an_attention_image_at_each_validation(run):
    events = _events(run)
    assert events.Tags()["images"] == ["attention/self"]  # a classifier's one kind
    images = events.Images("attention/self")
    valid_steps = [r["step"] for r in RunDir.open(run).read_metrics() if r.get("split") == "valid"]
    assert [image.step for image in images] == valid_steps == [3, 6]
    for image in images:
        picture = PIL.Image.open(io.BytesIO(image.encoded_image_string))
        assert picture.size == (image.width, image.height)
        assert picture.width > 200 and picture.height > 200


def test_the_drawn_weights_are_the_models_attention_on_the_first_validation_example(run):
    """The sample's maps equal what ``attnlab attention`` captures for the same input (another path)."""
    loaded = open_run(run)
    codec = TextCodec(loaded.task, loaded.tokenizer)
    sample = attention_sample(loaded.task, codec, model_kind="encoder_classifier", max_length=64, truncate=False)
    maps = sample_maps(loaded.model, sample)
    queries, keys = sample.axes["self"]
    text = "".join(queries[:-1])  # the symbols before EOS
    assert loaded.task.split("valid")[0].source == tuple(sample.batch.src[0].tolist())
    view = attention_view(loaded, text)
    assert view.axes["self"][0][:-1] == queries[:-1] and len(view.axes["self"][1]) == len(keys)  # EOS named apart
    reference = kind_maps(view, "self")
    assert len(maps["self"]) == len(reference) == 2
    for ours, theirs in zip(maps["self"], reference, strict=True):
        assert ours.shape == (2, len(queries), len(keys))
        np.testing.assert_allclose(ours, theirs, atol=1e-6)
        np.testing.assert_allclose(ours.sum(-1), 1.0, atol=1e-5)


def test_config_json_records_log_to_and_verify_skips_the_event_folder(run):
    assert RunDir.open(run).read_config()["train"]["log_to"] == ["jsonl", "tensorboard"]
    assert run_experiment(RunDir.open(run)).train.log_to == ["jsonl", "tensorboard"]
    assert not [check for check in verify_run(run).files if check.path.startswith(TENSORBOARD_FOLDER)]


def test_an_encoder_decoder_sample_has_all_three_kinds_on_its_own_axes():
    experiment = ExperimentConfig.from_dict(
        {
            "task": {"name": "reverse", "max_train_length": 5, "train_size": 16, "valid_size": 4, "test_size": 4},
            "model": {"kind": "encoder_decoder", "layers": 2, "d_model": 8, "heads": 2, "d_ff": 16, "dropout": 0.1},
        }
    )
    task, tokenizer = build_task(experiment.task)
    torch.manual_seed(0)
    model = model_for_task(experiment, task).train()
    codec = TextCodec(task, tokenizer)
    sample = attention_sample(task, codec, model_kind="encoder_decoder", max_length=32, truncate=False)
    maps = sample_maps(model, sample)
    assert model.training  # its mode is given back
    assert sorted(maps) == ["cross", "decoder_self", "encoder_self"]
    for kind, layers in maps.items():
        queries, keys = sample.axes[kind]
        assert len(layers) == 2
        for weights in layers:
            assert weights.shape == (2, len(queries), len(keys))
            np.testing.assert_allclose(weights.sum(-1), 1.0, atol=1e-5)
    first = task.split("valid")[0]
    assert len(sample.axes["cross"][0]) == len(first.target) + 1  # BOS + target reads the source
    assert len(sample.axes["cross"][1]) == len(first.source)
    np.testing.assert_array_equal(np.triu(maps["decoder_self"][0][0], 1), 0.0)  # causal: no later key
    # eval mode: no dropout, so the same maps twice (dropout at 0.1 would move them by far more
    # than 1e-5; equal to rounding only, since oneDNN's packed weights, made at a weight's second
    # use, can round differently from its first, unpacked use: seen on an Intel Xeon with AMX)
    again = sample_maps(model, sample)
    for kind in maps:
        for ours, theirs in zip(maps[kind], again[kind], strict=True):
            np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=0)


def test_without_tensorboard_no_event_file_is_written(tmp_path):
    train(_experiment(steps=2, eval_every=0, checkpoint_every=0, log_to=["jsonl"], final_splits=[]), tmp_path / "run")
    assert not (tmp_path / "run" / TENSORBOARD_FOLDER).exists()
    assert not list((tmp_path / "run").rglob("*tfevents*"))
    assert RunDir.open(tmp_path / "run").read_config()["train"]["log_to"] == ["jsonl"]
    assert isinstance(open_sink(["jsonl"], tmp_path / "other"), NoSink)
    assert not (tmp_path / "other").exists()


def test_a_crashed_session_is_flushed_and_a_resume_hides_what_it_logged_after_its_checkpoint(tmp_path, monkeypatch):
    real_step = trainer_module._Trainer._train_step
    calls = {"n": 0}

    def crashing_step(self):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 6:  # steps 1-5 done and logged, the checkpoint at step 3 the last
            raise KeyboardInterrupt
        return real_step(self)

    real_close, closed = TensorBoardSink.close, []

    def counted_close(self):  # noqa: ANN001, ANN202
        closed.append(self)
        real_close(self)

    monkeypatch.setattr(TensorBoardSink, "close", counted_close)
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", crashing_step)
    path = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(_experiment(), path, progress=False)
    assert len(closed) == 1  # closed (flushed) on the way out of the failed session
    monkeypatch.setattr(trainer_module._Trainer, "_train_step", real_step)
    crashed = _scalars(_events(path))  # closed on the way out: every event is on disk
    assert sorted(step for tag, step in crashed if tag == "train/loss") == [1, 2, 3, 4, 5]
    rate_before = {step: value for (tag, step), value in crashed.items() if tag == "train/examples_per_s"}

    train(run_experiment(RunDir.open(path)), path, resume=True, progress=False)
    assert len(closed) == 2
    assert len(list((path / TENSORBOARD_FOLDER).glob("events.out.tfevents.*"))) == 2  # appended, not replaced
    found = _scalars(_events(path))  # steps 4 and 5 once each: the resumed session's
    assert found == _expected(path)
    assert sorted(step for tag, step in found if tag == "train/loss") == [1, 2, 3, 4, 5, 6]
    assert found["train/examples_per_s", 2] == rate_before[2]
    assert found["train/examples_per_s", 4] != rate_before[4]  # the rate is measured anew
    assert [image.step for image in _events(path).Images("attention/self")] == [3, 6]


def test_a_missing_tensorboard_package_is_a_config_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ConfigError) as caught:
        train(_experiment(), tmp_path / "run", progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("train.log_to: ")
    assert "pip install 'attnlab[tensorboard]'" in message
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ('["jsonl", "tb"]', "train.log_to: unknown 'tb'; allowed: jsonl, tensorboard"),
        ('["tensorboard"]', 'train.log_to: must include "jsonl"'),
        ("[]", 'train.log_to: must include "jsonl"'),
        ('["jsonl", "jsonl"]', "train.log_to: 'jsonl' is given twice"),
        ("[1]", "train.log_to: expected names (jsonl, tensorboard), got 1"),
        ("tensorboard", 'train.log_to: expected a list such as ["jsonl", "tensorboard"]'),
    ],
)
def test_bad_log_to_values_are_one_line_config_errors(tmp_path, value, expected):
    config = tmp_path / "tiny.toml"
    config.write_text('[task]\nname = "parity"\n[model]\nkind = "encoder_classifier"\n')
    with pytest.raises(ConfigError) as caught:
        load_experiment(config, [f"train.log_to={value}"], flag="--set")
    assert str(caught.value).startswith(expected)
    assert "\n" not in str(caught.value)


def test_log_to_defaults_to_jsonl_only():
    assert _experiment(log_to=["jsonl"]).train.log_to == ["jsonl"]
    assert ExperimentConfig.from_dict({"task": PARITY, "model": CLASSIFIER}).train.log_to == ["jsonl"]
