"""Unbounded inputs and unusable outputs are refused before any work: one ``error:`` line, exit 2,
nothing created (issue 23, "Bounded resources"). Run in-process through :func:`attnlab.cli.main`."""

from __future__ import annotations

from pathlib import Path

import pytest

from attnlab import resources, runtime
from attnlab.cli import main
from attnlab.experiment import ExperimentConfig
from attnlab.training.trainer import train

EXPERIMENT = {
    "task": {
        "name": "reverse",
        "max_train_length": 4,
        "train_size": 40,
        "valid_size": 8,
        "test_size": 8,
        "length_generalisation_size": 4,
    },
    "model": {
        "kind": "encoder_decoder",
        "layers": 1,
        "d_model": 16,
        "heads": 2,
        "d_ff": 32,
        "dropout": 0.0,
    },
    "train": {"steps": 2, "batch_size": 8, "log_every": 0},
}

CONFIG_TOML = """
[task]
name = "reverse"
max_train_length = 4
train_size = 40
valid_size = 8
test_size = 8
length_generalisation_size = 4

[model]
kind = "encoder_decoder"
layers = 1
d_model = 16
heads = 2
d_ff = 32

[train]
steps = 2
batch_size = 8
log_every = 0
"""

LONG_TEXT = "a" * 100_000
LONG_NAME = "x" * 300


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "run"
    with pytest.MonkeyPatch.context() as patch:
        # aten's GEMMs: no C++ kernel to build on a fresh machine; the checks tested here come before any kernel.
        patch.setenv("ATTNLAB_LINEAR", "aten")
        train(ExperimentConfig.from_dict(EXPERIMENT), path, progress=False)
    return path


@pytest.fixture
def place(tmp_path, trained, monkeypatch) -> Path:
    """A working folder with a config, a corpus, a file, a full folder and a copy of the run's path."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: True)  # leave pytest's malloc alone
    (tmp_path / "c.toml").write_text(CONFIG_TOML)
    (tmp_path / "corpus.txt").write_text("the cat sat on the mat\nthe dog sat\n")
    (tmp_path / "existing.csv").write_text("kind,layer\n")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    return tmp_path


def _listing(*folders: Path) -> list[tuple[str, int]]:
    return sorted((str(p), p.stat().st_size) for folder in folders for p in folder.rglob("*"))


CASES = [
    # (argv, words the error line must hold)
    (["train", "c.toml", "--out", "new", "--set", "model.layers=10000"], ["model.layers", "10,000"]),
    (
        ["train", "c.toml", "--out", "new", "--set", "train.batch_size=1000000000"],
        ["train.batch_size", "training split (40 examples)"],
    ),
    (["train", "c.toml", "--out", "new", "--set", "task.train_size=1000000000"], ["task.train_size", "cap"]),
    (["train", "c.toml", "--out", LONG_NAME], ["--out", "300 bytes long"]),
    (["train", "c.toml", "--out", "full"], ["--out full", "not empty"]),
    (["train", "c.toml", "--out", "existing.csv/run"], ["--out", "existing.csv is a file"]),
    (["demo", "--out", LONG_NAME], ["--out", "300 bytes long"]),
    (["generate", "{run}", LONG_TEXT], ["TEXT", "100,000 characters", "20,000"]),
    (["generate", "{run}", "a" * 600], ["TEXT", "tokens", "model.max_len"]),
    (["generate", "{run}", "abc", "a" * 600], ["TEXT 2", "tokens", "model.max_len"]),
    (["generate", "{run}", ""], ["TEXT", "empty"]),
    (["generate", "{run}", "--beam", "1000000", "abc"], ["--beam", "256"]),
    (["generate", "{run}", "--max-length", "100000000", "abc"], ["--max-length", "4096"]),
    (["attention", "{run}", LONG_TEXT, "--out", "pictures"], ["TEXT", "100,000 characters"]),
    (["attention", "{run}", "", "--out", "pictures"], ["TEXT", "empty"]),
    (["attention", "{run}", "a" * 600, "--out", "pictures"], ["TEXT", "tokens", "model.max_len"]),
    (["attention", "{run}", "abc", "--out", "existing.csv"], ["--out", "existing.csv is a file"]),
    (["encode", "{run}", ""], ["TEXT", "empty"]),
    (["encode", "{run}", "fine", LONG_TEXT], ["TEXT 2", "100,000 characters"]),
    (["word2vec", "corpus.txt", "--dim", "1000000000", "--out", "v.txt"], ["--dim", "65536"]),
    (["word2vec", "corpus.txt", "--dim", "8", "--out", "full"], ["--out full", "is a folder"]),
    (["word2vec", "corpus.txt", "--dim", "8", "--out", LONG_NAME], ["--out", "300 bytes long"]),
    (["heads", "ablate", "{run}", "--out", "existing.csv"], ["--out", "existing.csv is a file"]),
    (["heads", "importance", "{run}", "--out", "full"], ["--out full", "is a folder"]),
    (["heads", "prune", "{run}", "--percent", "50", "--out", "existing.csv"], ["--out", "existing.csv is a file"]),
    (["heads", "prune", "{run}", "--percent", "50", "--physical", "--out", "full"], ["--out full", "not empty"]),
    (["import", "bert", "nowhere", "--out", "full"], ["--out full", "not empty"]),
    (["bench", "attention", "--save", "existing.csv"], ["--save", "existing.csv is a file"]),
    (["tokenize", "--kind", "char", LONG_TEXT], ["TEXT", "100,000 characters", "20,000"]),
    (["tokenize", "--kind", "bpe", "x"], ["--kind bpe", "--train CORPUS or --tokenizer FILE"]),
    (["tokenize", "--kind", "wordpiece", "x"], ["--kind wordpiece", "--train CORPUS or --tokenizer FILE"]),
    # text inputs are read through one capped reader: an endless file is refused after one bounded read
    (["tokenize", "--kind", "bpe", "--train", "/dev/zero", "x"], ["/dev/zero", "bytes", "MAX_INPUT_BYTES"]),
    (["word2vec", "/dev/zero", "--dim", "8", "--out", "v.txt"], ["/dev/zero", "bytes", "MAX_INPUT_BYTES"]),
    (["train", "/dev/zero", "--out", "new"], ["/dev/zero", "bytes", "MAX_INPUT_BYTES"]),
]


@pytest.mark.parametrize("argv,words", CASES, ids=[" ".join(a)[:60] for a, _ in CASES])
def test_refused_before_any_work(place, trained, capsys, argv, words):
    argv = [arg.replace("{run}", str(trained)) for arg in argv]
    before = _listing(place, trained)
    with pytest.raises(SystemExit) as exited:
        main(argv)
    captured = capsys.readouterr()
    assert exited.value.code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err
    for word in words:
        assert word in lines[0], lines[0]
    assert _listing(place, trained) == before  # no run directory, no pictures, no vectors, nothing


def test_a_model_too_large_for_this_machine_names_the_estimate_and_the_memory(place, capsys, monkeypatch):
    monkeypatch.setattr(resources, "available_memory", lambda: 2**30)  # 1 GiB free
    before = _listing(place)
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "train",
                "c.toml",
                "--out",
                "new",
                "--set",
                "model.d_model=2048",
                "--set",
                "model.d_ff=8192",
                "--set",
                "model.layers=8",
            ]
        )
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 4  # resources: a valid request this machine cannot hold
    assert error.startswith("error: training this model") and "needs about" in error
    assert "1.0 GiB this machine has available" in error and "reduce model.layers, model.d_model" in error
    assert _listing(place) == before


def test_a_model_no_machine_holds_is_a_resource_error_exit_4(place, capsys):
    """A valid request over the memory estimate is exit code 4 (resources), not a usage mistake."""
    before = _listing(place)
    with pytest.raises(SystemExit) as exited:
        main(["train", "c.toml", "--out", "new", "--set", "model.d_model=1000000000"])
    error = capsys.readouterr().err.strip()
    assert exited.value.code == 4, error
    assert error.startswith("error: ") and "\n" not in error
    for word in ("needs about", "GiB", "available", "model.d_model"):
        assert word in error, error
    assert _listing(place) == before


def test_eval_texts_from_an_endless_file_is_one_error_line(tmp_path, capsys, monkeypatch):
    """``eval RUN --texts /dev/zero`` once read 7.9 GB; a corpus is now streamed by byte offsets
    (any size of file, bounded memory), so a device that is not a regular file is refused before
    any read, with one error line."""
    from tests.unit.analysis.tiny_runs import tiny_run

    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: True)
    run = tiny_run(tmp_path / "lm", "decoder_only")
    for argv in (["eval", str(run), "--texts", "/dev/zero"], ["heads", "ablate", str(run), "--texts", "/dev/zero"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert err == "error: /dev/zero: not a regular file (a corpus is read by byte offsets)\n"


DIGITS = "9" * 5_000


@pytest.mark.parametrize(
    "argv",
    [
        ["eval", "{run}", "--checkpoint", f"step-{DIGITS}"],
        ["eval", "{run}", "--mask-head", f"self:{DIGITS}:0"],
        ["attention", "{run}", "abc", "--out", "pictures", "--layers", f"1-{DIGITS}"],
        ["train", "c.toml", "--out", "new", "--set", f"model.d_model={DIGITS}"],
        ["train", "c.toml", "--out", "new", "--set", "train.seed=99999999999999999999999"],
        ["generate", "{run}", "--seed", str(10**30), "abc"],
    ],
    ids=["checkpoint", "mask-head", "layers", "set-digits", "set-seed", "generate-seed"],
)
def test_numbers_too_large_for_their_field_are_one_short_error_line(place, trained, capsys, argv):
    """Never Python's "Exceeds the limit (4300 digits)" or an int64 overflow as an internal error,
    and never the 5,000 digits echoed back."""
    before = _listing(place, trained)
    with pytest.raises(SystemExit) as exited:
        main([arg.replace("{run}", str(trained)) for arg in argv])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    assert "internal error" not in err and len(err) < 400, err
    assert _listing(place, trained) == before


def test_normal_inputs_still_work(place, trained, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["generate", str(trained), "--beam", "2", "abc"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("abc\t")


def test_temperature_zero_is_greedy_decoding_as_the_help_says(place, trained, capsys, monkeypatch):
    """``--temperature 0`` is not a division by zero nor an error: it is greedy decoding, the default."""
    outputs = []
    for extra in ([], ["--temperature", "0"], ["--temperature", "0", "--seed", "5"]):
        with pytest.raises(SystemExit) as exited:
            main(["generate", str(trained), "abc", "abca", *extra])
        assert exited.value.code == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2] and outputs[0].startswith("abc\t")
    monkeypatch.setenv("COLUMNS", "300")  # one row per option: its help unbroken
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    assert "0 means greedy decoding" in " ".join(capsys.readouterr().out.split())


def test_decoding_stops_at_the_last_learned_position(tmp_path, capsys, monkeypatch):
    """A model with learned positions has none past model.max_len: decoding stops there, no crash."""
    monkeypatch.setattr(runtime, "keep_freed_memory", lambda: True)
    experiment = {**EXPERIMENT, "model": {**EXPERIMENT["model"], "positional": "learned", "max_len": 8}}
    run = tmp_path / "learned"
    train(ExperimentConfig.from_dict(experiment), run, progress=False)
    for argv in (
        ["generate", str(run), "abc", "--max-length", "64"],
        ["attention", str(run), "abc", "--max-length", "64", "--out", str(tmp_path / "pictures")],
    ):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith("abc\t")
