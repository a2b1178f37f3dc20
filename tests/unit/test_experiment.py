"""Config files: a bad key or value is a ConfigError naming it as the config does (section.key),
raised when the config is read, before any training file is opened."""

from __future__ import annotations

import json
import re

import pytest

from attnlab.errors import ConfigError
from attnlab.experiment import ExperimentConfig, load_experiment
from attnlab.run.directory import RunDir
from attnlab.run.loaded import run_experiment
from attnlab.tasks import get_task
from attnlab.tasks.registry import build_task

MODEL = {"kind": "encoder_decoder", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32}
LM_MODEL = {"kind": "decoder_only", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32}
COPY = {
    "name": "copy",
    "max_train_length": 4,
    "train_size": 8,
    "valid_size": 4,
    "test_size": 4,
    "length_generalisation_size": 4,
}


def _config(task: dict, model: dict = MODEL) -> ExperimentConfig:
    return ExperimentConfig.from_dict({"task": task, "model": model})


@pytest.mark.parametrize(
    "text,message",
    [
        ('task = "copy"\n[model]\nkind = "encoder_decoder"\n', "task: expected a [task] table, got str 'copy'"),
        ('model = 3\n[task]\nname = "copy"\n', "model: expected a [model] table, got int 3"),
        (
            'train = [1, 2]\n[task]\nname = "copy"\n[model]\nkind = "encoder_decoder"\n',
            "train: expected a [train] table",
        ),
        ('[model]\nkind = "encoder_decoder"\n', "missing section [task]"),
    ],
)
def test_a_section_that_is_not_a_table_is_named(tmp_path, text, message):
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(path)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(path, ["train.seed=1"])  # an override into a scalar section does not hide it


@pytest.mark.parametrize(
    "change,message",
    [
        ({"train_size": "x"}, "task.train_size: expected int, got 'x'"),
        ({"seed": 1.5}, "task.seed: expected int, got 1.5"),
        ({"num_symbols": True}, "task.num_symbols: expected int, got True"),
        ({"train_size": -5}, "task.train_size: must be >= 0, got -5"),
        ({"max_train_length": 0}, "task.max_train_length: must be >= 1, got 0"),
        ({"num_symbols": 100}, r"task.num_symbols: must lie in \[1, 26\], got 100"),
    ],
)
def test_a_bad_task_option_is_named_with_its_section(change, message):
    with pytest.raises(ConfigError, match=message):
        build_task(_config({**COPY, **change}).task)


@pytest.mark.parametrize(
    "override,message",
    [
        ("train.lr=nan", "train.lr: must be a finite number, got nan"),
        ("train.clip_norm=inf", "train.clip_norm: must be a finite number, got inf"),
        ("model.layer_norm_eps=nan", "model.layer_norm_eps: must be a finite number, got nan"),
        ("model.dropout=-inf", "model.dropout: must be a finite number, got -inf"),
    ],
)
def test_nan_and_inf_options_are_named(tmp_path, override, message):
    # TOML has nan and inf literals; `nan <= 0` is False, so range checks alone let them through.
    path = tmp_path / "c.toml"
    path.write_text('[task]\nname = "copy"\n[model]\nkind = "encoder_decoder"\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = load_experiment(path, [override])
        config.model_config(vocab_size=10, pad_id=0)


DIGITS = "9" * 5_000


@pytest.mark.parametrize(
    "override,message",
    [
        (f"model.d_model={DIGITS}", "--set model.d_model: a number of more than 4,300 digits, too large for any key"),
        (f"model.d_model={2**70}", "model.d_model: 1,180,591,620,717,411,303,424 is too large for this key"),
        ("train.seed=99999999999999999999999", "train.seed: must lie in [0, 9,223,372,036,854,775,807]"),
        ("train.seed=-1", "train.seed: must lie in [0, 9,223,372,036,854,775,807] (attnlab.limits.MAX_SEED), got -1"),
        ("task.seed=99999999999999999999999", "task.seed: must lie in [0, 9,223,372,036,854,775,807]"),
        ("train.steps=1000000000", "train.steps: 1,000,000,000 steps, more than the cap of 10,000,000"),
        ("task.valid_size=0", "task.valid_size: must be >= 1 (the validation split scores training), got 0"),
        (
            "task.max_train_length=1000000000000",
            "task.max_train_length: 1,000,000,000,000, more than the cap of 4,096",
        ),
    ],
)
def test_integers_out_of_their_range_are_one_config_error_naming_the_key(tmp_path, override, message):
    """Too large for the field, a seed outside [0, 2**63 - 1], more steps than the cap, an empty
    validation split: a ConfigError naming the key, never an overflow inside PyTorch."""
    path = tmp_path / "c.toml"
    path.write_text('[task]\nname = "copy"\n[model]\nkind = "encoder_decoder"\n')
    with pytest.raises(ConfigError, match=re.escape(message)):
        config = load_experiment(path, [override], flag="--set")
        config.model_config(vocab_size=10, pad_id=0)
        build_task(config.task)


def test_a_config_file_with_a_5000_digit_number_is_named(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(f'[task]\nname = "copy"\n[train]\nsteps = {DIGITS}\n')
    with pytest.raises(ConfigError, match=re.escape(f"{path}: a number of more than 4,300 digits")):
        load_experiment(path)


def test_get_task_checks_option_types_before_the_task_compares_them():
    with pytest.raises(ConfigError, match="task.train_size: expected int, got '8'"):
        get_task("copy", train_size="8")
    assert get_task("copy", train_size=8, max_train_length=3).kind == "seq2seq"


@pytest.mark.parametrize(
    "change,message",
    [
        ({"train_file": 3}, "task.train_file: expected str or PathLike, got 3"),
        ({"skip_bad_lines": "yes"}, "task.skip_bad_lines: expected bool, got 'yes'"),
        ({"vocab_size": "big"}, "task.vocab_size: expected int, got 'big'"),
        ({"vocab_size": 3}, "task.vocab_size: must be at least 7, got 3"),
        ({"tokenizer_kind": "nope"}, "task.tokenizer_kind: unknown tokenizer kind 'nope'; choose one of word"),
        ({"tokenizer": 5}, "task.tokenizer: expected str or None, got 5"),
        ({"max_train_length": "long"}, "task.max_train_length: expected int or None, got 'long'"),
    ],
)
def test_text_task_keys_are_checked_before_the_training_file_is_read(tmp_path, change, message):
    missing = str(tmp_path / "not-there.txt")  # were it read first, the error would name this file
    with pytest.raises(ConfigError, match=message):
        _config({"name": "lm", "train_file": missing, **change}, LM_MODEL)


def test_good_text_task_keys_train_the_tokenizer_they_ask_for(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"the cat sat on mat number {i}" for i in range(50)), encoding="utf-8")
    config = _config({"name": "lm", "train_file": str(corpus), "tokenizer_kind": "word", "vocab_size": 30}, LM_MODEL)
    task, tokenizer = build_task(config.task)
    assert tokenizer is not None and tokenizer.kind == "word"
    assert tokenizer.vocab_size <= 30
    assert task.vocab_size == tokenizer.vocab_size


@pytest.mark.parametrize("name,line", [("lm", "the cat sat"), ("translation", "the cat\tle chat")])
def test_a_line_length_bound_below_one_names_the_key_not_a_line(tmp_path, name, line):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(f"{line}\n" * 5, encoding="utf-8")
    model = LM_MODEL if name == "lm" else MODEL
    config = _config({"name": name, "train_file": str(corpus), "max_line_chars": 0}, model)
    with pytest.raises(ConfigError, match="task.max_line_chars: must be >= 1, got 0"):
        build_task(config.task)


def test_a_config_path_that_is_a_folder_is_named(tmp_path):
    with pytest.raises(ConfigError, match=f"{tmp_path}: cannot read the config: Is a directory"):
        load_experiment(tmp_path)


@pytest.mark.parametrize(
    "config,message",
    [
        ({"task": COPY, "model": MODEL, "train": {"steps": "x"}}, "train.steps: expected int, got 'x'"),
        ([1, 2], "expected a table of sections [task], [model], [train]; got list"),
    ],
)
def test_a_bad_run_config_is_named_by_its_file(tmp_path, config, message):
    run = RunDir.create(tmp_path / "run")
    (run.path / "config.json").write_text(json.dumps(config))  # as edited by hand
    with pytest.raises(ConfigError, match=re.escape(f"{run.path / 'config.json'}: {message}")):
        run_experiment(run)
    run.write_config({"task": COPY, "model": MODEL})
    assert run_experiment(run).task_name == "copy"


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ({"foo": 1}, "model.foo: unknown key; allowed: kind, activation"),
        ({"layers": 2, "foo": 1}, "model.foo: unknown key; allowed: kind,"),
        ({"vocab_size": 9}, "model.vocab_size: set by the task, not by the config"),
        ({"layers": 2}, "model.kind: missing; allowed: encoder_decoder, encoder_classifier, decoder_only, encoder"),
        (
            {"kind": "encoder_decoder", "foo": 1},
            "model.foo: unknown key for kind 'encoder_decoder'; allowed: kind, layers",
        ),
    ],
)
def test_an_unknown_model_key_is_named_with_or_without_a_kind(tmp_path, model, message):
    lines = "\n".join(f"{key} = {json.dumps(value)}" for key, value in model.items())
    path = tmp_path / "c.toml"
    path.write_text(f'[task]\nname = "reverse"\n[model]\n{lines}\n', encoding="utf-8")
    with pytest.raises(ConfigError, match="^" + re.escape(message)):
        load_experiment(path)


@pytest.mark.parametrize("kind", ["encoder_decoder", "encoder_classifier", "decoder_only", "encoder"])
@pytest.mark.parametrize(
    "task",
    [
        {"name": "copy"},
        {"name": "parity"},
        {"name": "lm", "train_file": "t.txt"},
        {"name": "translation", "train_file": "t.tsv"},
        {"name": "sentences"},
    ],
)
def test_every_option_is_filled_in_so_config_json_is_complete(kind, task):
    import dataclasses

    from attnlab.experiment import TASK_DECIDES, TrainConfig
    from attnlab.nn import MODELS
    from attnlab.tasks.registry import TEXT_TASK_EXTRAS, task_options

    config = ExperimentConfig.from_dict({"task": task, "model": {"kind": kind}}).to_dict()
    assert set(config["model"]) == {"kind"} | set(MODELS[kind][0].field_names()) - set(TASK_DECIDES)
    extras = set(TEXT_TASK_EXTRAS.get(task["name"], ()))
    assert set(config["task"]) == {"name"} | set(task_options(task["name"])) | extras
    assert set(config["train"]) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert json.loads(json.dumps(config)) == config  # what config.json holds, read back unchanged
    assert ExperimentConfig.from_dict(config).to_dict() == config


def test_an_old_config_json_without_newer_keys_still_loads(tmp_path):
    run = RunDir.create(tmp_path / "run")
    run.write_config(
        {"task": {"name": "copy"}, "model": {"kind": "encoder_decoder", "layers": 1}, "train": {"steps": 5}}
    )  # written before max_len, threads, ... were recorded
    experiment = run_experiment(run)
    assert experiment.model["layers"] == 1 and experiment.model["max_len"] == 512
    assert experiment.train.threads == 0 and experiment.task["num_symbols"] == 10


@pytest.mark.parametrize("linear", ["auto", "aten", "onednn"])
def test_an_old_config_json_with_the_linear_kernel_opens_with_the_key_ignored(tmp_path, linear):
    """``model.linear`` (the GEMM kernel) was written into every config.json until it became the
    runtime setting ATTNLAB_LINEAR: such a run still opens, builds its model, and drops the key."""
    run = RunDir.create(tmp_path / "run")
    run.write_config({"task": COPY, "model": {**MODEL, "linear": linear}, "train": {"steps": 5}})
    experiment = run_experiment(run)
    assert "linear" not in experiment.model and "linear" not in experiment.to_dict()["model"]
    assert experiment.model_config(vocab_size=12).layers == 1


def test_given_values_are_kept_and_a_changed_kind_is_still_checked():
    config = _config(COPY, {**MODEL, "max_len": 64})
    assert config.model["max_len"] == 64 and config.task["train_size"] == 8
    with pytest.raises(ConfigError, match="model.decoder_layers: unknown key for kind 'decoder_only'"):
        config.with_overrides(['model.kind="decoder_only"'])


@pytest.mark.parametrize(
    "change,message",
    [
        ({"loss": "l2"}, r"^train\.loss: unknown 'l2'; allowed: bce, mse$"),
        ({"select": "best_test"}, r"^train\.select: unknown 'best_test'; allowed: last, best_valid$"),
        ({"stop_at_accuracy": 1.5, "eval_every": 10}, r"^train\.stop_at_accuracy: must lie in \[0, 1\]"),
        ({"stop_at_accuracy": 0.999}, r"^train\.stop_at_accuracy: needs evaluations during training"),
        ({"select": "best_valid"}, r"^train\.select: needs evaluations during training"),
        ({"oracle": True}, r"^train\.oracle: needs evaluations during training; set train\.eval_every > 0$"),
    ],
)
def test_the_protocol_options_of_train_are_checked_naming_the_key(change, message):
    with pytest.raises(ConfigError, match=message):
        ExperimentConfig.from_dict(
            {"task": {"name": "dyck1"}, "model": {"kind": "encoder_classifier"}, "train": change}
        )


def test_the_bhattamishra_config_loads_with_the_papers_protocol_for_every_grid_language():
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "configs" / "papers" / "bhattamishra2020.toml"
    for language in ("dyck1", "parity"):
        experiment = load_experiment(path, [f"task.name={language}"])
        task = build_task(experiment.task)[0]
        assert (task.sampler, task.p, task.q, task.distinct) == ("pcfg", 0.5, 0.25, True)
        assert task.lengths("train") == range(1, 51) and list(task.length_bins) == ["length_51_100", "length_101_150"]
        assert (experiment.train.loss, experiment.train.stop_at_accuracy, experiment.train.oracle) == (
            "mse",
            0.999,
            True,
        )
        assert experiment.train.select == "last"
