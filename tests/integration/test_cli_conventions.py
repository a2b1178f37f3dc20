"""The conventions every command shares: ``--json`` prints one JSON object and nothing else on
stdout; ``--progress/--no-progress`` draws its bars on stderr only; ``--device auto|cpu|cuda|cuda:N``
runs the model where asked (``auto`` and ``cpu`` give today's CPU results), a bad or missing device
being one ``error:`` line with exit code 2.

In process (``attnlab.cli.main``) on one tiny word-level language model, trained once for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.cli import demo as demo_command
from attnlab.cli import main
from attnlab.kernels import native_build
from tests.tiny_run import build_tiny_run

NO_GPU = not torch.cuda.is_available()


def attnlab(capsys, *argv: object) -> tuple[int, str, str]:
    """Run one command in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([str(arg) for arg in argv])
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


def one_json_object(capsys, *argv: object) -> tuple[dict, str]:
    """Run a command with --json; its stdout must be exactly one JSON object. Returns it and stderr."""
    code, out, err = attnlab(capsys, *argv, "--json")
    assert code == 0, err
    assert out.count("\n") == 1, out
    result = json.loads(out)
    assert isinstance(result, dict)
    return result, err


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("conventions")
    build_tiny_run(path)
    return path


@pytest.fixture(scope="module")
def run(folder) -> Path:
    return folder / "run"


@pytest.fixture(scope="module")
def config(folder) -> Path:
    """The tiny run's experiment as a TOML file for `attnlab train`."""
    path = folder / "tiny.toml"
    path.write_text(
        f"""[task]
name = "lm"
train_file = "{folder / "train.txt"}"
tokenizer_kind = "word"
vocab_size = 64

[model]
kind = "decoder_only"
layers = 1
d_model = 8
heads = 2
d_ff = 16
max_len = 16
dropout = 0.0

[train]
steps = 3
batch_size = 8
log_every = 1
checkpoint_every = 0
eval_every = 0
"""
    )
    return path


# ---- --json --------------------------------------------------------------------------------------


def test_train_json_summarises_the_run_and_logs_on_stderr(capsys, config, tmp_path):
    out = tmp_path / "trained"
    result, err = one_json_object(capsys, "train", config, "--out", out, "--no-progress", "--device", "auto")
    assert set(result) == {"run", "steps", "steps_this_session", "final_loss", "valid", "device", "seconds"}
    assert result["run"] == str(out) and result["steps"] == 3 == result["steps_this_session"]
    assert result["final_loss"] == json.loads((out / "metrics.jsonl").read_text().splitlines()[2])["loss"]
    assert result["device"] == ("cpu" if NO_GPU else "cuda")
    assert json.loads((out / "config.json").read_text())["train"]["device"] == result["device"]
    assert result["valid"] is None or "loss" in result["valid"]
    assert not any(line.lstrip().startswith("{") for line in err.splitlines())  # the log, never the JSON


def test_heads_json_ablate_importance_prune(capsys, run, tmp_path):
    ablation, _ = one_json_object(
        capsys, "heads", "ablate", run, "--split", "train", "--out", tmp_path, "--no-progress"
    )
    assert {"run", "metric_name", "held_heads", "baseline", "single", "keep_one", "files"} <= set(ablation)
    assert [(r["kind"], r["layer"], r["head"]) for r in ablation["single"]] == [("self", 0, 0), ("self", 0, 1)]
    assert set(ablation["baseline"]) == {"metric", "loss"}
    assert Path(ablation["files"]["ablation"]).is_file() and len(ablation["files"]["heatmaps"]) == 1

    scores, _ = one_json_object(
        capsys, "heads", "importance", run, "--split", "train", "--out", tmp_path / "imp.csv", "--no-progress"
    )
    assert [set(row) for row in scores["importance"]] == [{"kind", "layer", "head", "importance"}] * 2
    assert all(row["importance"] >= 0 for row in scores["importance"])
    assert scores["csv"] == str(tmp_path / "imp.csv")

    curve, _ = one_json_object(
        capsys, "heads", "prune", run, "--split", "train", "--percent", "0", "50", "--out", tmp_path, "--no-progress"
    )
    assert [(row["percent"], row["heads_pruned"]) for row in curve["curve"]] == [(0.0, 0), (50.0, 1)]
    assert curve["curve"][0]["metric"] == pytest.approx(ablation["baseline"]["metric"])

    pruned, _ = one_json_object(
        capsys, "heads", "prune", run, "--split", "train", "--percent", "50", "--physical", "--out", tmp_path / "small"
    )
    assert len(pruned["pruned"]) == 1 and pruned["heads"] == 2
    assert pruned["parameters"]["after"] < pruned["parameters"]["before"]
    assert pruned["max_difference"] < 1e-4 and pruned["pruned_run"] == str(tmp_path / "small")


def test_attention_and_word2vec_json(capsys, folder, run, tmp_path):
    view, _ = one_json_object(capsys, "attention", run, "the cat", "--out", tmp_path / "maps", "--max-length", "4")
    assert view["input"] == "the cat" and isinstance(view["output"], str)
    assert view["pictures"] and all(Path(p).is_file() for p in view["pictures"])

    vectors, _ = one_json_object(
        capsys, "word2vec", folder / "train.txt", "--dim", "4", "--epochs", "1", "--out", tmp_path / "v.txt"
    )
    assert vectors["dim"] == 4 and vectors["lines"] == 120 and vectors["left_out"] == []
    assert int((tmp_path / "v.txt").read_text().split()[0]) == vectors["words"]


def test_import_bert_json(capsys, tmp_path):
    from tests.unit.pretrained.tiny_bert import write_tiny_bert

    source = write_tiny_bert(tmp_path / "src")
    imported, _ = one_json_object(capsys, "import", "bert", source, "--out", tmp_path / "run")
    assert imported["run"] == str(tmp_path / "run") and imported["pooling"] in ("mean", "cls")
    assert {"layers", "heads", "d_model", "d_ff", "vocab_size", "parameters", "max_tokens", "skipped"} <= set(imported)


def test_demo_json(capsys, monkeypatch, tmp_path):
    small = json.loads(json.dumps(demo_command.DEMO_CONFIG))
    small["task"].update(train_size=64, valid_size=8, test_size=8, length_generalisation_size=8)
    small["train"].update(steps=2, warmup=1, checkpoint_every=0)
    monkeypatch.setattr(demo_command, "DEMO_CONFIG", small)
    result, err = one_json_object(capsys, "demo", "--out", tmp_path / "demo", "--no-progress")
    assert result["examples"] == 8 and 0.0 <= result["accuracy"] <= 1.0 and len(result["decoded"]) == 3
    assert Path(result["heatmap"]).read_bytes()[:4] == b"\x89PNG"
    assert "training an encoder-decoder" in err


# ---- --progress ----------------------------------------------------------------------------------


@pytest.mark.parametrize("command", [("heads", "importance"), ("eval",)])
def test_progress_bars_go_to_stderr_only(capsys, run, tmp_path, command):
    out_args = ("--out", tmp_path / "imp.csv") if command[-1] == "importance" else ()
    code, out, err = attnlab(capsys, *command, run, "--split", "train", *out_args, "--progress")
    assert code == 0, err
    assert "it/s" in err or "batch/s" in err or "s/it" in err
    assert "it/s" not in out and "\r" not in out
    code, out, quiet = attnlab(capsys, *command, run, "--split", "train", *out_args, "--no-progress")
    assert code == 0 and quiet == ""


# ---- --device ------------------------------------------------------------------------------------


def test_device_auto_and_cpu_give_the_results_of_no_flag(capsys, run):
    runs = [one_json_object(capsys, "eval", run, "--split", "train", *flag)[0] for flag in ((), ("--device", "cpu"))]
    if NO_GPU:
        runs.append(one_json_object(capsys, "eval", run, "--split", "train", "--device", "auto")[0])
    assert all(result == runs[0] for result in runs)
    texts = [attnlab(capsys, "generate", run, "the cat", *flag)[1] for flag in ((), ("--device", "cpu"))]
    assert texts[0] == texts[1] and texts[0].startswith("the cat\t")


@pytest.mark.parametrize("name", ["cuda:x", "tpu", "CPU", "cuda:"])
@pytest.mark.parametrize("command", [("eval", "{run}"), ("heads", "importance", "{run}"), ("train", "{config}")])
def test_a_malformed_device_is_one_usage_error(capsys, run, config, command, name):
    argv = [arg.format(run=run, config=config) for arg in command]
    code, out, err = attnlab(capsys, *argv, "--device", name)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1
    assert f"Invalid value for '--device': '{name}'" in err and "allowed: auto, cpu, cuda, cuda:N" in err


@pytest.mark.skipif(not NO_GPU, reason="a GPU is visible")
@pytest.mark.parametrize("command", [("eval", "{run}"), ("generate", "{run}", "the"), ("attention", "{run}", "the")])
def test_cuda_without_a_gpu_is_one_usage_error(capsys, run, command):
    argv = [arg.format(run=run) for arg in command]
    code, out, err = attnlab(capsys, *argv, "--device", "cuda")
    assert code == 2 and out == ""
    assert err == (
        f"error: attnlab {command[0]}: Invalid value for '--device': 'cuda': 'cuda' asked for, "
        "but no CUDA device is visible; use cpu or auto\n"
    )


@pytest.mark.skipif(NO_GPU, reason="no CUDA device")
def test_on_the_gpu_eval_importance_and_generate_match_the_cpu(capsys, run, tmp_path):
    on = {}
    for device in ("cpu", "cuda"):
        metrics, _ = one_json_object(capsys, "eval", run, "--split", "train", "--device", device)
        scores, _ = one_json_object(
            capsys, "heads", "importance", run, "--split", "train", "--out", tmp_path / f"{device}.csv",
            "--no-progress", "--device", device,
        )  # fmt: skip
        view, _ = one_json_object(capsys, "attention", run, "the cat", "--out", tmp_path / device, "--device", device)
        on[device] = metrics, [row["importance"] for row in scores["importance"]], view["output"]
    (cpu_metrics, cpu_scores, cpu_output), (gpu_metrics, gpu_scores, gpu_output) = on["cpu"], on["cuda"]
    assert gpu_metrics["loss"] == pytest.approx(cpu_metrics["loss"], abs=1e-4)
    assert gpu_metrics["examples"] == cpu_metrics["examples"]
    assert gpu_scores == pytest.approx(cpu_scores, abs=1e-4)
    assert gpu_output == cpu_output


def test_tokenize_json_has_tokens_and_ids_of_one_tokenizer(capsys):
    result, _ = one_json_object(capsys, "tokenize", "--kind", "word", "the cat the dog")
    assert result["kind"] == "word" and result["text"] == "the cat the dog"
    assert result["tokens"] == ["the", "cat", "the", "dog"]
    assert len(result["ids"]) == 4 and result["ids"][0] == result["ids"][2] != result["ids"][1]
    code, out, _ = attnlab(capsys, "tokenize", "--kind", "word", "the cat the dog")
    assert code == 0 and json.loads(out) == result["tokens"]


_HOLD_THE_BUILD_LOCK = """
import sys, time
from attnlab.kernels import native_build, native_spec
spec = native_spec.build_spec()
spec.directory.mkdir(parents=True, exist_ok=True)
with native_build._exclusive(spec.directory / native_build._LOCK_NAME):
    print(spec.directory / native_build._LOCK_NAME, flush=True)
    time.sleep(120)
"""


@pytest.mark.skipif(native_build.fcntl is None, reason="no fcntl on this platform")
def test_a_command_waiting_for_another_process_kernel_build_says_so_and_gives_up_after_the_limit(run, tmp_path):
    """Another process holds the kernels' build lock (a build in progress): a command that needs the
    kernels says in one line whose build it waits for and for how long, and past
    ATTNLAB_BUILD_WAIT_S goes on with PyTorch's paths after one ``warning:`` line."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions"), "ATTNLAB_BUILD_WAIT_S": "0.5"}
    env.pop("ATTNLAB_NATIVE", None)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_THE_BUILD_LOCK], env=env, stdout=subprocess.PIPE, text=True)
    try:
        lock = holder.stdout.readline().strip()
        assert lock.endswith(native_build._LOCK_NAME)
        done = subprocess.run(
            [sys.executable, "-m", "attnlab", "eval", str(run), "--no-progress", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    assert done.returncode == 0, done.stderr
    assert "loss" in json.loads(done.stdout)
    assert done.stderr.splitlines() == [
        f"attnlab: waiting for another process's build of the C++ CPU kernels (pid {holder.pid}, lock {lock}); "
        "giving up after 0.5 s (ATTNLAB_BUILD_WAIT_S)",
        f"warning: attnlab's CPU kernels are not available (another process's build (pid {holder.pid}) still held "
        f"{lock} after 0.5 s (ATTNLAB_BUILD_WAIT_S)); attnlab uses PyTorch's serial transposes, NumPy's dropout "
        "words and PyTorch's fused attention instead (slower, same results)",
    ]
