"""The train / eval / generate / demo commands: their outputs and every bad-input path (exit 2)."""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.run.directory import RunDir
from tests.cli import attnlab
from tests.toy_corpora import write_number_words

TINY = """
[task]
name = "{task}"
max_train_length = 4
train_size = 200
valid_size = 20
test_size = 20
length_generalisation_size = 20
[model]
kind = "{kind}"
layers = 1
d_model = 16
heads = 2
d_ff = 32
[train]
steps = 5
batch_size = 8
log_every = 1
"""


def _error(result: subprocess.CompletedProcess[str], code: int = 2) -> str:
    assert result.returncode == code, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return result.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cli")
    config = folder / "reverse.toml"
    config.write_text(TINY.format(task="reverse", kind="encoder_decoder"))
    result = attnlab("train", str(config), "--out", str(folder / "run"), "--no-progress")
    assert result.returncode == 0, result.stderr
    return folder / "run"


def test_train_writes_a_complete_run(trained):
    names = {p.name for p in trained.iterdir()}
    assert {"config.json", "model.safetensors", "checkpoint.json", "metrics.jsonl", "plots", "checkpoints"} <= names
    records = RunDir.open(trained).read_metrics()
    steps = [r for r in records if "split" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5]
    assert all({"loss", "lr", "tokens_per_s"} <= set(r) for r in steps)
    assert any(r.get("split") == "valid" for r in records)
    assert (trained / "plots" / "loss.png").stat().st_size > 0


def test_eval_json_has_per_length_accuracy(trained):
    result = attnlab("eval", str(trained), "--split", "length_generalisation", "--json", "--no-progress")
    metrics = json.loads(result.stdout)
    assert metrics["split"] == "length_generalisation" and metrics["examples"] == 20
    assert set(metrics["accuracy_by_length"]) <= {"5", "6", "7", "8"}
    assert {"accuracy", "sequence_accuracy", "token_accuracy", "loss", "perplexity"} <= set(metrics)


def test_eval_of_an_empty_split_is_exit_2(tmp_path):
    config = tmp_path / "reverse.toml"
    config.write_text(TINY.format(task="reverse", kind="encoder_decoder").replace("test_size = 20", "test_size = 0"))
    assert attnlab("train", str(config), "--out", str(tmp_path / "run"), "--no-progress").returncode == 0
    stderr = _error(attnlab("eval", str(tmp_path / "run"), "--split", "test", "--no-progress"))
    assert "--split: the 'test' split of this run's task has no examples" in stderr
    assert "splits with examples: train, valid, length_generalisation" in stderr


def test_generate_decodes(trained):
    result = attnlab("generate", str(trained), "abc", "dd", "--json")
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["input"] for line in lines] == ["abc", "dd"]
    from attnlab.run.loaded import open_run

    alphabet = set(open_run(trained).task.vocab.tokens[3:])
    assert all(set(line["output"]) <= alphabet and line["log_prob"] <= 0 for line in lines)


def test_the_run_records_its_kernels_and_the_attention_setting_is_chosen_at_open(trained):
    """The run's kernel choices are in kernels.json (fixed: training's reproducible default), and
    --attention picks the implementation once for generate and eval: explicit gives what the
    recorded default gives; an unknown one is one error line naming the setting."""
    kernels = json.loads((trained / "kernels.json").read_text())
    assert kernels["mode"] == "fixed" and kernels["choices"]
    default = attnlab("generate", str(trained), "abc", "--json")
    explicit = attnlab("generate", str(trained), "abc", "--json", "--attention", "explicit")
    assert default.returncode == explicit.returncode == 0, explicit.stderr
    assert json.loads(explicit.stdout)["output"] == json.loads(default.stdout)["output"]
    scored = attnlab("eval", str(trained), "--split", "valid", "--json", "--no-progress", "--attention", "sdpa")
    assert scored.returncode == 0, scored.stderr
    assert "unknown 'flash'" in _error(attnlab("generate", str(trained), "abc", "--attention", "flash"))


def test_a_refused_resume_leaves_the_run_as_it_was(trained, tmp_path):
    """CONFIG with --resume, or a --set of a model key, is a usage error (exit 2) before any weight
    is read or any metric appended; the same value as the run's is no change and is accepted."""
    config = tmp_path / "c.toml"
    config.write_text(TINY.format(task="reverse", kind="encoder_decoder"))
    before = {p: p.read_bytes() for p in sorted(trained.rglob("*")) if p.is_file()}
    for args in (
        ("train", str(config), "--resume", str(trained)),
        ("train", "--resume", str(trained), "--set", "model.layers=3"),
    ):
        result = attnlab(*args, "--no-progress")
        assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert {p: p.read_bytes() for p in sorted(trained.rglob("*")) if p.is_file()} == before


def test_resume_continues_to_more_steps(trained, tmp_path):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(copy)], check=True)
    result = attnlab("train", "--resume", str(copy), "--set", "train.steps=7", "--no-progress")
    assert result.returncode == 0, result.stderr
    assert RunDir.open(copy).latest_checkpoint().step == 7


@pytest.mark.parametrize(
    "args,message",
    [
        (("train", "missing.toml"), "config file not found: missing.toml"),
        (("train",), "give a CONFIG.toml to train, or --resume RUN"),
        (("train", "{config}", "--set", "model.heads=3"), "model.d_model: 16 is not divisible by heads=3"),
        (
            ("train", "{config}", "--set", "model.score=cosine"),
            "model.score: unknown 'cosine'; allowed: additive, bilinear, dot, scaled_dot",
        ),
        (
            ("train", "{config}", "--set", "model.depth=3"),
            "model.depth: unknown key for kind 'encoder_decoder'; allowed: kind, layers",
        ),
        (("train", "{config}", "--set", "train.steps=-1"), "train.steps: must be >= 1"),
        (("train", "{config}", "--set", "train.lr=fast"), "train.lr: expected float or int, got 'fast'"),
        (("train", "{config}", "--set", "task.name=fibonacci"), "task.name: unknown 'fibonacci'; allowed: parity"),
        (
            ("train", "{config}", "--set", "task.colour=3"),
            "task.colour: unknown key for task 'reverse'; allowed: max_train_length",
        ),
        (("train", "{config}", "--set", "oops"), "--set 'oops': expected section.key=value"),
        (
            ("train", "{config}", "--set", "model.kind=decoder_only"),
            "model.kind: task 'reverse' trains a encoder_decoder model",
        ),
        pytest.param(
            ("train", "{config}", "--device", "cuda"),
            "no CUDA device is visible",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
        (
            ("train", "{config}", "--precision", "fp8"),
            "Invalid value for '--precision': 'fp8': 'fp8' is not one of 'fp32', 'bf16', 'fp16'",
        ),
        (("train", "{bad_toml}"), "invalid TOML"),
        (("train", "{scalar_toml}"), "task: expected a [task] table, got str 'reverse'"),
        (("train", "{config}", "--set", "task.train_size=many"), "task.train_size: expected int, got 'many'"),
        (("train", "{config}", "--out", "{run}"), "already exists and is not empty"),
        (("train", "--resume", "{empty}"), "is not a run directory: it has no config.json"),
        (("train", "{config}", "--resume", "{run}"), "not with --resume, which continues"),
        (
            ("train", "--resume", "{run}", "--set", "model.layers=3", "--set", "task.max_train_length=5"),
            "--set task.max_train_length, model.layers: a resume cannot change [model] or [task] keys",
        ),
        (("eval", "no/such/run"), "run not found: no/such/run"),
        (
            ("eval", "{run}", "--split", "dev"),
            "--split: unknown split 'dev'; this run's task has",
        ),
        (("generate", "{run}", "xyz"), "symbol 'x' is not in the task's alphabet"),
        (("generate", "no/such/run", "abc"), "run not found"),
    ],
)
def test_bad_input_exits_2_with_a_one_line_message(trained, tmp_path, args, message):
    config = tmp_path / "c.toml"
    config.write_text(TINY.format(task="reverse", kind="encoder_decoder"))
    bad_toml = tmp_path / "bad.toml"
    bad_toml.write_text("[task\nname = 1")
    scalar_toml = tmp_path / "scalar.toml"
    scalar_toml.write_text('task = "reverse"\n[model]\nkind = "encoder_decoder"\n')  # task as a key, not a table
    (tmp_path / "empty").mkdir()
    filled = [
        a.format(config=config, bad_toml=bad_toml, scalar_toml=scalar_toml, run=trained, empty=tmp_path / "empty")
        for a in args
    ]
    stderr = _error(attnlab(*filled))
    assert message in stderr
    assert len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("damage", ["truncate", "garbage", "pickle"])
def test_corrupt_checkpoint_is_a_clear_error(trained, tmp_path, damage):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(copy)], check=True)
    weights = copy / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()  # break the hard link before writing
    if damage == "truncate":
        weights.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        weights.write_bytes(b"\x00" * 64)
    elif damage == "pickle":
        import pickle

        weights.write_bytes(pickle.dumps({"weights": [1, 2, 3]}))
    stderr = _error(attnlab("eval", str(copy), "--no-progress"), code=3)
    assert stderr.startswith(f"error: {weights} is damaged: ") and stderr.count("\n") == 1  # per manifest.json
    if damage == "pickle":  # a run without a manifest (older attnlab): the safetensors reader still refuses
        (copy / "manifest.json").unlink()
        stderr = _error(attnlab("eval", str(copy), "--no-progress"), code=3)
        assert stderr.startswith("warning: ") and "has no manifest.json" in stderr
        assert f"error: weights {weights} is corrupted or not a safetensors file" in stderr


def test_missing_published_weights_fall_back_to_the_checkpoint(trained, tmp_path):
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(trained), str(copy)], check=True)
    (copy / "model.safetensors").unlink()
    assert attnlab("eval", str(copy), "--no-progress").returncode == 0
    for folder in (copy / "checkpoints").iterdir():
        (folder / "model.safetensors").unlink()
    assert "weights not found" in _error(attnlab("eval", str(copy), "--no-progress"), code=3)


def _toy_translation(path: Path, n: int, seed: int) -> None:
    write_number_words(path, n, seed=seed, max_digits=4)


def test_translation_with_word2vec_initialisation_reports_bleu(tmp_path):
    data = tmp_path / "train.tsv"
    _toy_translation(data, 400, seed=1)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(line.replace("\t", " ") for line in data.read_text().splitlines()) + "\n")
    vectors = tmp_path / "vectors.txt"
    result = attnlab("word2vec", str(corpus), "--dim", "16", "--out", str(vectors))
    assert result.returncode == 0, result.stderr
    config = tmp_path / "t.toml"
    config.write_text(
        f'[task]\nname = "translation"\ntrain_file = "{data}"\ntokenizer_kind = "word"\nvocab_size = 100\n'
        '[model]\nkind = "encoder_decoder"\nlayers = 1\nd_model = 16\nheads = 2\nd_ff = 32\n'
        f'[train]\nsteps = 30\nbatch_size = 16\nlr = 3e-3\nwarmup = 5\ninit_embeddings = "{vectors}"\n'
    )
    result = attnlab("train", str(config), "--out", str(tmp_path / "run"), "--no-progress")
    assert result.returncode == 0, result.stderr
    assert "tokens (" in result.stdout and "initialised from vectors" in result.stdout
    coverage = [r for r in RunDir.open(tmp_path / "run").read_metrics() if "coverage" in r]
    assert {r["embedding"] for r in coverage} == {"encoder.embedding", "decoder.embedding"}
    assert all(r["coverage"] > 0.9 for r in coverage)  # every word of the corpus has a vector
    metrics = json.loads(attnlab("eval", str(tmp_path / "run"), "--split", "valid", "--json", "--no-progress").stdout)
    assert 0.0 <= metrics["bleu"] <= 100.0 and "token_accuracy" in metrics
    out = attnlab("generate", str(tmp_path / "run"), "three one four")
    assert out.returncode == 0 and out.stdout.startswith("three one four\t")


def test_language_model_reports_perplexity(tmp_path):
    rng = random.Random(0)
    corpus, held_out = tmp_path / "corpus.txt", tmp_path / "held_out.txt"
    for path, lines in ((corpus, 300), (held_out, 40)):
        words = ["the cat", "a dog", "sat", "ran", "on the mat"]
        path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(4)) for _ in range(lines)) + "\n")
    config = tmp_path / "lm.toml"
    config.write_text(
        f'[task]\nname = "lm"\ntrain_file = "{corpus}"\ntest_file = "{held_out}"\ntokenizer_kind = "bpe"\n'
        'vocab_size = 300\n[model]\nkind = "decoder_only"\nlayers = 1\nd_model = 16\nheads = 2\nd_ff = 32\n'
        "tie_embeddings = true\n[train]\nsteps = 20\nbatch_size = 16\nlr = 3e-3\nwarmup = 5\n"
    )
    result = attnlab("train", str(config), "--out", str(tmp_path / "run"), "--no-progress")
    assert result.returncode == 0, result.stderr
    metrics = json.loads(attnlab("eval", str(tmp_path / "run"), "--split", "test", "--json", "--no-progress").stdout)
    assert 1.0 < metrics["perplexity"] < 300.0
    # the same lines given as --texts (BOS text EOS, as trained) score what the split scores
    on_file = json.loads(attnlab("eval", str(tmp_path / "run"), "--texts", str(held_out), "--json").stdout)
    assert on_file["texts"] == metrics["examples"] == 40
    assert on_file["loss"] == pytest.approx(metrics["loss"], abs=1e-5)
    assert on_file["perplexity"] == pytest.approx(metrics["perplexity"], rel=1e-5)
    scores = attnlab("heads", "importance", str(tmp_path / "run"), "--texts", str(held_out), "--json",
                     "--no-progress", "--out", str(tmp_path / "importance.csv"))  # fmt: skip
    assert scores.returncode == 0, scores.stderr
    assert [row["head"] for row in json.loads(scores.stdout)["importance"]] == [0, 1]
    out = attnlab("generate", str(tmp_path / "run"), "the cat", "--max-length", "5", "--json")
    assert out.returncode == 0, out.stderr
    assert "continuation" in json.loads(out.stdout)


def test_the_llama_style_config_trains_and_decodes(tmp_path):
    """configs/lm_llama.toml (rotary positions, grouped-query attention, RMSNorm, SwiGLU, no
    biases) on the shipped sentences, shrunk to a few steps: it trains, evaluates and generates."""
    config = Path(__file__).resolve().parents[2] / "configs" / "lm_llama.toml"
    sets = ["train.steps=6", "train.batch_size=8", "model.layers=2", "model.d_model=32", "model.d_ff=48"]
    sets += ["task.vocab_size=200", "train.eval_every=6", "train.checkpoint_every=6"]
    result = attnlab(
        "train", str(config), "--out", str(tmp_path / "run"), "--no-progress", *(f"--set={s}" for s in sets)
    )
    assert result.returncode == 0, result.stderr
    model = json.loads((tmp_path / "run" / "config.json").read_text())["model"]
    assert (model["positional"], model["kv_heads"], model["norm"], model["activation"]) == ("rope", 2, "rms", "swiglu")
    metrics = json.loads(attnlab("eval", str(tmp_path / "run"), "--json", "--no-progress").stdout)
    assert 1.0 < metrics["perplexity"] < 1000.0
    out = attnlab("generate", str(tmp_path / "run"), "The module", "--max-length", "4", "--json")
    assert out.returncode == 0, out.stderr


def test_skipped_bad_lines_are_counted(tmp_path):
    data = tmp_path / "train.tsv"
    _toy_translation(data, 200, seed=2)
    with open(data, "a") as handle:
        handle.write("no tab on this line\nthree\ttabs\there\n")
    config = tmp_path / "t.toml"
    config.write_text(
        f'[task]\nname = "translation"\ntrain_file = "{data}"\ntokenizer_kind = "word"\nvocab_size = 50\n'
        '[model]\nkind = "encoder_decoder"\nlayers = 1\nd_model = 16\nheads = 2\nd_ff = 32\n'
        "[train]\nsteps = 2\nbatch_size = 8\n"
    )
    refused = attnlab("train", str(config), "--out", str(tmp_path / "a"), "--no-progress")
    assert refused.returncode == 2 and f"{data}:201" in refused.stderr
    result = attnlab(
        "train", str(config), "--out", str(tmp_path / "b"), "--no-progress", "--set", "task.skip_bad_lines=true"
    )
    assert result.returncode == 0, result.stderr
    assert "skipped 2 bad lines" in result.stdout
