"""Malformed invocations of every command: one ``error: ...`` line naming the culprit, exit code 2.

Each case runs :func:`attnlab.cli.main` in this process (no interpreter start per case) on a tiny
run trained once for the module. A case is ``(argv, expected words)``: argv may name the fixtures'
paths in braces (``{run}``, ``{out}``, ...); stderr must be exactly one line, ``error: ...``, holding
every expected word, with no traceback and nothing printed to stdout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from attnlab.cli import last_resort, main
from attnlab.errors import EXIT_CORRUPT, EXIT_INTERNAL, EXIT_RESOURCES, EXIT_USAGE
from attnlab.experiment import ExperimentConfig
from attnlab.training.trainer import train

EXPERIMENT = {
    "task": {
        "name": "reverse",
        "max_train_length": 4,
        "train_size": 64,
        "valid_size": 8,
        "test_size": 8,
        "length_generalisation_size": 8,
    },
    # max_len 8: lengths 5..8 of the length-generalisation split need 9 positions (with EOS).
    "model": {
        "kind": "encoder_decoder",
        "layers": 1,
        "d_model": 8,
        "heads": 2,
        "d_ff": 16,
        "dropout": 0.0,
        "max_len": 8,
    },
    "train": {
        "steps": 2,
        "batch_size": 16,
        "lr": 3e-3,
        "warmup": 1,
        "log_every": 0,
        "eval_every": 0,
        "checkpoint_every": 0,
    },
}

TOML = """[task]
name = "reverse"
max_train_length = 3
train_size = 16
valid_size = 4
test_size = 4
length_generalisation_size = 4

[model]
kind = "encoder_decoder"
layers = 1
d_model = 8
heads = 2
d_ff = 16

[train]
steps = 1
"""

LONG_NAME = "n" * 300  # beyond the 255 bytes a file name may have (ENAMETOOLONG); messages may shorten it


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, Path]:
    """The files the cases name: a trained run, configs, corpora, a BERT folder with 0 heads."""
    folder = tmp_path_factory.mktemp("cli-errors")
    run = folder / "run"
    train(ExperimentConfig.from_dict(EXPERIMENT), run, progress=False)
    (folder / "config.toml").write_text(TOML, encoding="utf-8")
    (folder / "unknown_key.toml").write_text('[task]\nname = "reverse"\n[model]\nfoo = 1\n', encoding="utf-8")
    (folder / "unknown_key_kind.toml").write_text(TOML.replace("heads = 2", "heads = 2\ncolour = 3"), encoding="utf-8")
    (folder / "broken.toml").write_text("[task\nname = 1\n", encoding="utf-8")
    (folder / "corpus.txt").write_text("the cat sat\nthe dog ran\n", encoding="utf-8")
    (folder / "binary.txt").write_bytes(b"\xff\xfe\x00bad\n")
    (folder / "a_file").write_text("not a folder\n", encoding="utf-8")
    (folder / "not_a_run").mkdir()
    bert = folder / "bert"
    bert.mkdir()
    hf = {
        "model_type": "bert",
        "vocab_size": 8,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 0,
        "intermediate_size": 16,
        "max_position_embeddings": 16,
    }
    (bert / "config.json").write_text(json.dumps(hf), encoding="utf-8")
    (bert / "model.safetensors").write_bytes(b"")  # never read: the config is refused first
    (bert / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\nthe\ncat\nsat\n", encoding="utf-8")
    indivisible = folder / "bert3"
    indivisible.mkdir()
    for name in ("model.safetensors", "vocab.txt"):
        (indivisible / name).write_bytes((bert / name).read_bytes())
    (indivisible / "config.json").write_text(json.dumps({**hf, "num_attention_heads": 3}), encoding="utf-8")
    missing_key = folder / "bert_missing"
    missing_key.mkdir()
    for name in ("model.safetensors", "vocab.txt"):
        (missing_key / name).write_bytes((bert / name).read_bytes())
    without_width = {key: value for key, value in hf.items() if key != "hidden_size"}
    (missing_key / "config.json").write_text(json.dumps({**without_width, "num_attention_heads": 2}), encoding="utf-8")
    return {
        "run": run,
        "dir": folder,
        "config": folder / "config.toml",
        "unknown_key": folder / "unknown_key.toml",
        "unknown_key_kind": folder / "unknown_key_kind.toml",
        "broken": folder / "broken.toml",
        "corpus": folder / "corpus.txt",
        "binary": folder / "binary.txt",
        "file": folder / "a_file",
        "not_a_run": folder / "not_a_run",
        "missing": folder / "missing",
        "bert": bert,
        "bert3": indivisible,
        "bert_missing": missing_key,
        "long": folder / LONG_NAME,
    }


# (argv, words the one error line must hold). Braces name entries of the `paths` fixture; {out} is
# a fresh folder of the test's own.
CASES: list[tuple[list[str], list[str]]] = [
    # --- click's usage errors, every command ---
    (["no-such-command"], ["No such command", "no-such-command"]),
    (["--no-such-flag"], ["--no-such-flag"]),
    (["info", "--no-such-flag"], ["attnlab info", "--no-such-flag"]),
    (["info", "extra"], ["unexpected extra argument", "extra"]),
    (["train", "{config}", "--no-such-flag"], ["attnlab train", "--no-such-flag"]),
    (["train", "{config}", "--nproc", "0"], ["--nproc"]),
    (["train", "{config}", "--nproc", "two"], ["--nproc", "two"]),
    (["train", "{config}", "--nproc", "2", "--set", 'train.device="cuda:1"'], ["--nproc 2", "'cuda:1' names one GPU"]),
    (["train", "{config}", "--nproc", "64", "--set", 'train.device="cuda"'], ["--nproc 64", "need one GPU each"]),
    (["train", "{config}", "--set"], ["--set", "requires an argument"]),
    (["train", "{config}", "--out"], ["--out", "requires an argument"]),
    (["eval"], ["Missing argument", "run"]),
    (["eval", "{run}", "--batch-size", "0"], ["--batch-size"]),
    (["eval", "{run}", "--batch-size", "many"], ["--batch-size", "many"]),
    (["eval", "{run}", "--no-such-flag"], ["attnlab eval", "--no-such-flag"]),
    (["generate", "{run}"], ["Missing argument", "texts"]),
    (["generate", "{run}", "ab", "--beam", "0"], ["--beam"]),
    (["generate", "{run}", "ab", "--max-length", "x"], ["--max-length"]),
    (["generate", "{run}", "ab", "--length-penalty", "-1"], ["--length-penalty"]),
    (["attention", "{run}", "ab"], ["Missing option", "--out"]),
    (["attention", "{run}"], ["Missing argument", "text"]),
    (["attention", "{run}", "ab", "--out", "{out}", "--max-length", "0"], ["--max-length"]),
    (["encode"], ["Missing argument", "run"]),
    (["encode", "{run}"], ["Missing argument", "texts"]),
    (["encode", "{run}", "ab", "--batch-size", "-3"], ["--batch-size"]),
    (["tokenize"], ["Missing argument", "text"]),
    (["tokenize", "x", "--kind", "bpe", "--vocab-size", "3"], ["--vocab-size"]),
    (["word2vec", "{corpus}", "--out", "{out}/v.txt"], ["Missing option", "--dim"]),
    (["word2vec", "{corpus}", "--dim", "0", "--out", "{out}/v.txt"], ["--dim"]),
    (["word2vec", "{corpus}", "--dim", "4", "--out", "{out}/v.txt", "--window", "0"], ["--window"]),
    (["word2vec", "{corpus}", "--dim", "4"], ["Missing option", "--out"]),
    (["heads", "no-such-analysis"], ["attnlab heads", "no-such-analysis"]),
    (["heads", "ablate"], ["attnlab heads ablate", "Missing argument", "run"]),
    (["heads", "importance", "{run}", "--batch-size", "0"], ["--batch-size"]),
    (["heads", "importance", "{run}", "--no-such-flag"], ["attnlab heads importance", "--no-such-flag"]),
    (["heads", "prune", "{run}"], ["Missing option", "--percent"]),
    (["heads", "prune", "{run}", "--percent", "half"], ["--percent", "half"]),
    (["heads", "prune", "{run}", "--percent", "10", "20", "stray"], ["unexpected extra argument", "stray"]),
    (["heads", "prune", "{run}", "--percent", "10", "--percent", "x"], ["--percent", "'x'"]),
    (["import", "no-such-format"], ["attnlab import", "no-such-format"]),
    (["import", "bert", "{bert}"], ["Missing option", "--out"]),
    (["demo", "--no-such-flag"], ["attnlab demo", "--no-such-flag"]),
    (["demo", "extra"], ["unexpected extra argument", "extra"]),
    (["bench"], ["Missing argument", "name"]),
    (["bench", "train", "--no-such-flag"], ["attnlab bench", "--no-such-flag"]),
    (["view"], ["Missing argument", "run"]),
    (["view", "{run}", "--port", "70000"], ["--port", "70000"]),
    (["view", "{run}", "--port", "http"], ["--port", "http"]),
    # --- attnlab's own checks of keys, values, files ---
    (["train"], ["CONFIG.toml", "--resume"]),
    (["train", "{unknown_key}"], ["model.foo: unknown key", "allowed", "d_model"]),
    (["train", "{unknown_key_kind}"], ["model.colour: unknown key", "allowed"]),
    (["train", "{config}", "--set", "model.bar=1"], ["model.bar: unknown key"]),
    (["train", "{config}", "--set", "train.nope=1"], ["train.nope: unknown key"]),
    (["train", "{config}", "--set", "colour.red=1"], ["unknown section [colour]"]),
    (["train", "{config}", "--set", "steps=3"], ["--set", "section.key=value"]),
    (["train", "{config}", "--set", "model.heads=0"], ["model.heads"]),
    (["train", "{config}", "--set", "task.name=nope"], ["task.name", "nope"]),
    (["train", "{config}", "--device", "tpu"], ["--device", "tpu", "auto, cpu, cuda, cuda:N"]),
    (["train", "{config}", "--precision", "fp8"], ["--precision", "fp8", "fp32", "bf16", "fp16"]),
    (["train", "{missing}"], ["{missing}"]),
    (["train", "{broken}"], ["{broken}", "invalid TOML"]),
    (["train", "{config}", "--out", "{long}"], [LONG_NAME[:17], "long"]),
    (["train", "{config}", "--out", "{file}"], ["a_file", "--out"]),
    (["train", "--resume", "{missing}"], ["run not found", "{missing}"]),
    (["train", "--resume", "{not_a_run}"], ["{not_a_run}", "config.json"]),
    (["eval", "{missing}"], ["run not found", "{missing}"]),
    (["eval", "{not_a_run}"], ["{not_a_run}", "config.json"]),
    (["eval", "{run}", "--split", "nope"], ["--split", "nope"]),
    (["eval", "{run}", "--texts", "{corpus}"], ["--texts", "needs a language model run", "task 'reverse'"]),
    (["eval", "{run}", "--mask-head", "bogus"], ["bogus"]),
    (["eval", "{run}", "--mask-head", "cross:7:0"], ["cross:7:0"]),
    (
        ["eval", "{run}", "--split", "length_generalisation", "--no-truncate", "--no-progress"],
        ["max_length=8", "--truncate"],
    ),
    (["generate", "{missing}", "ab"], ["run not found"]),
    (["attention", "{run}", "ab", "--out", "{file}"], ["a_file"]),
    (["encode", "{run}", "ab"], ["encode", "sentence encoder"]),
    (["tokenize", "x"], ["--kind"]),
    (["tokenize", "--kind", "nope", "x"], ["--kind", "nope"]),
    (["tokenize", "--tokenizer", "{missing}", "x"], ["{missing}"]),
    (["tokenize", "--vocab", "{missing}", "x"], ["{missing}"]),
    (["tokenize", "--kind", "bpe", "--train", "{binary}", "x"], ["{binary}"]),
    (["tokenize", "--vocab", "{corpus}", "--tokenizer", "{corpus}", "x"], ["--tokenizer", "--vocab"]),
    (["word2vec", "{missing}", "--dim", "4", "--out", "{out}/v.txt"], ["{missing}"]),
    (["heads", "ablate", "{run}", "--split", "nope"], ["--split", "nope"]),
    (["heads", "ablate", "{run}", "--texts", "{corpus}", "--pairs", "{corpus}"], ["--texts", "--pairs"]),
    (["heads", "importance", "{run}", "--kind", "nope"], ["nope"]),
    (["heads", "prune", "{missing}", "--percent", "10"], ["run not found"]),
    (["import", "bert", "{bert}", "--out", "{out}/run"], ["{bert}/config.json", "num_attention_heads", "got 0"]),
    (["import", "bert", "{bert3}", "--out", "{out}/run"], ["{bert3}/config.json", "not divisible", "3"]),
    (["import", "bert", "{bert_missing}", "--out", "{out}/run"], ["{bert_missing}/config.json", "hidden_size"]),
    (["import", "bert", "--out", "{out}/run"], ["SOURCE", "--package"]),
    (["import", "bert", "{missing}", "--out", "{out}/run"], ["{missing}", "not a folder"]),
    (["import", "bert", "{bert}", "--package", "x", "--out", "{out}/run"], ["SOURCE", "--package"]),
    (["bench", "nope"], ["name", "nope", "not one of", "train-headmask", "all"]),
    (["view", "{missing}"], ["run not found"]),
    (["demo", "--out", "{long}"], [LONG_NAME[:17], "long"]),
    (["demo", "--out", "{file}"], ["a_file"]),
]


def _commands() -> set[str]:
    from typer.main import get_command

    from attnlab.cli.app import app

    return set(get_command(app).commands)  # type: ignore[attr-defined]


# Commands added beside this file's own (e.g. `verify`) get at least click's usage errors.
CASES += [
    ([name, "--no-such-flag"], [f"attnlab {name}", "--no-such-flag"])
    for name in sorted(_commands() - {argv[0] for argv, _ in CASES})
]


def _fill(text: str, paths: dict[str, Path], out: Path) -> str:
    return text.format(out=out, **{name: str(path) for name, path in paths.items()})


def _call(capsys, argv: list[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    code = exit_info.value.code
    return (0 if code is None else code), out, err


def test_there_are_enough_cases_and_every_command_has_some():
    assert len(CASES) >= 60
    named = {argv[0] for argv, _ in CASES}
    assert _commands() <= named, f"commands without a malformed case: {sorted(_commands() - named)}"


@pytest.mark.parametrize(("argv", "words"), CASES, ids=[" ".join(argv)[:60] for argv, _ in CASES])
def test_malformed_invocation_is_one_error_line(paths, tmp_path, capsys, argv, words):
    code, out, err = _call(capsys, [_fill(arg, paths, tmp_path) for arg in argv])
    assert code == EXIT_USAGE, err
    assert "Traceback" not in err and "Usage:" not in err and "Try '" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for word in words:
        assert _fill(word, paths, tmp_path) in lines[0], lines[0]
    assert "Traceback" not in out and "error:" not in out  # (demo says what it is about to do first)


def test_eval_truncate_cuts_long_inputs_and_says_how_many(paths, capsys):
    code, out, err = _call(
        capsys, ["eval", str(paths["run"]), "--split", "length_generalisation", "--truncate", "--json", "--no-progress"]
    )
    assert code == 0, err
    metrics = json.loads(out)
    assert metrics["examples"] == 8 and 0 < metrics["truncated"] <= 8
    assert (
        err.strip()
        == f"note: --truncate cut {metrics['truncated']} of 8 examples to the model's context of 8 positions"
    )


def test_each_kind_of_failure_has_its_own_exit_code(capsys):
    """usage 2, damaged data 3, resources 4, a diverged run 5: distinct, and listed under --help."""
    from attnlab.errors import CheckpointError, ConfigError, ResourceError, UsageError
    from attnlab.training.trainer import TrainingDiverged

    codes = [error.exit_code for error in (UsageError, ConfigError, CheckpointError, ResourceError, TrainingDiverged)]
    assert codes == [2, 2, 3, 4, 5]
    code, out, _ = _call(capsys, ["--help"])
    listing = " ".join(out.split())
    assert code == 0
    for words in ("2 bad usage", "3 corrupt", "4 not enough memory", "5 a diverged run"):
        assert words in listing, listing


def test_help_and_version_exit_0(capsys):
    code, out, err = _call(capsys, ["--help"])
    assert code == 0 and "Exit codes: 0 success; 1 internal error" in " ".join(out.split()) and err == ""
    code, out, _ = _call(capsys, ["eval", "--help"])
    assert code == 0 and "--truncate" in out
    code, out, _ = _call(capsys, ["--version"])
    assert code == 0 and out.startswith("attnlab ")


def test_no_arguments_show_the_help(capsys):
    code, out, err = _call(capsys, ["heads"])
    assert code == 2 and "ablate" in out + err and "Traceback" not in out + err


@pytest.mark.parametrize(
    ("error", "code", "message"),
    [
        (
            IsADirectoryError(21, "Is a directory", "run/model.safetensors"),
            EXIT_USAGE,
            "run/model.safetensors: Is a directory",
        ),
        (PermissionError(13, "Permission denied", "a", None, "b"), EXIT_USAGE, "a -> b: Permission denied"),
        (OSError(36, "File name too long", "x" * 300), EXIT_USAGE, "x" * 300 + ": File name too long"),
        (MemoryError(), EXIT_RESOURCES, "out of memory; use a smaller model, batch, input or --dim"),
        (
            MemoryError("Unable to allocate 7.45 GiB for an array with shape (1000000000, 2)"),
            EXIT_RESOURCES,
            "out of memory (asked for 7.45 GiB); use",
        ),
        (
            RuntimeError(
                "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                "you tried to allocate 4000000000000 bytes."
            ),
            EXIT_RESOURCES,
            "out of memory (asked for 4000000000000 bytes); use a smaller model",
        ),
        (
            RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has"),
            EXIT_RESOURCES,
            "out of memory (asked for 2.00 GiB); use",
        ),
        (RecursionError("maximum recursion depth exceeded"), EXIT_USAGE, "nested too deeply"),
        (
            UnicodeDecodeError("utf-8", b"ok\xff", 2, 3, "invalid start byte"),
            EXIT_CORRUPT,
            "not UTF-8 text: byte b'\\xff' at offset 2",
        ),
        (
            ZeroDivisionError("division by zero"),
            EXIT_INTERNAL,
            "internal error: ZeroDivisionError: division by zero (set ATTNLAB_TRACEBACK=1 to see the traceback)",
        ),
        (KeyError("x"), EXIT_INTERNAL, "internal error: KeyError: 'x'"),
    ],
)
def test_last_resort_gives_one_line_and_a_code(error, code, message):
    text, exit_code = last_resort(error)
    assert exit_code == code and message in text and "\n" not in text


def _raise_inside_a_command(error: BaseException, argv_name: str = "raise-something"):
    from attnlab.cli.app import app

    @app.command(argv_name, hidden=True)
    def _boom() -> None:
        raise error

    return app


@pytest.mark.parametrize("traceback", [False, True])
def test_an_unexpected_exception_is_one_line_unless_asked_for_the_traceback(capsys, monkeypatch, traceback):
    app = _raise_inside_a_command(ZeroDivisionError("division by zero"))
    try:
        if traceback:
            monkeypatch.setenv("ATTNLAB_TRACEBACK", "1")
            with pytest.raises(ZeroDivisionError):
                main(["raise-something"])
        else:
            monkeypatch.delenv("ATTNLAB_TRACEBACK", raising=False)
            code, _, err = _call(capsys, ["raise-something"])
            assert code == EXIT_INTERNAL
            assert err == (
                "error: internal error: ZeroDivisionError: division by zero "
                "(set ATTNLAB_TRACEBACK=1 to see the traceback)\n"
            )
    finally:
        app.registered_commands.pop()


def test_ctrl_c_is_interrupted_130(capsys):
    app = _raise_inside_a_command(KeyboardInterrupt())
    try:
        code, _, err = _call(capsys, ["raise-something"])
    finally:
        app.registered_commands.pop()
    assert code == 130 and err == "interrupted\n"
