"""`attnlab heads ...` and head masks through the CLI and in training (Michel et al.)."""

from __future__ import annotations

import csv
import json
import random
import subprocess
from pathlib import Path

import pytest
import torch

from attnlab.cli import main
from attnlab.experiment import ExperimentConfig, model_for_task
from attnlab.run.directory import RunDir
from attnlab.run.loaded import open_run
from attnlab.tasks.registry import build_task
from attnlab.training.trainer import train
from tests.cli import attnlab

EXPERIMENT = {
    "task": {
        "name": "reverse",
        "max_train_length": 4,
        "train_size": 300,
        "valid_size": 30,
        "test_size": 30,
        "length_generalisation_size": 10,
    },
    "model": {"kind": "encoder_decoder", "layers": 2, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
    "train": {"steps": 60, "batch_size": 16, "lr": 3e-3, "warmup": 5, "log_every": 0},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("heads") / "run"
    train(ExperimentConfig.from_dict(EXPERIMENT), path, progress=False)
    return path


def _csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        return list(reader.fieldnames or []), list(reader)


def test_ablate_writes_csvs_and_heatmaps(run, tmp_path):
    result = attnlab("heads", "ablate", str(run), "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    for name in ("ablation.csv", "keep_one.csv"):
        columns, rows = _csv(tmp_path / name)
        assert columns == ["kind", "layer", "head", "metric", "loss", "delta"]
        assert len(rows) == 3 * 2 * 2  # three kinds, two layers, two heads
    for kind in ("encoder_self", "decoder_self", "cross"):
        assert (tmp_path / f"ablation_{kind}.png").read_bytes()[:4] == b"\x89PNG"


def test_importance_csv_and_heatmap(run, tmp_path):
    out = tmp_path / "imp.csv"
    result = attnlab("heads", "importance", str(run), "--normalize-per-layer", "--out", str(out))
    assert result.returncode == 0, result.stderr
    columns, rows = _csv(out)
    assert columns == ["kind", "layer", "head", "importance"] and len(rows) == 12
    assert all(float(r["importance"]) >= 0 for r in rows)
    assert out.with_suffix(".png").exists()


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``attnlab ARGS`` in this process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


@pytest.mark.parametrize(
    "percents",
    [("--percent", "10", "20", "30"), ("--percent", "10", "--percent", "20", "30"), ("--percent=10", "20", "30")],
)
def test_prune_percent_takes_several_values(run, tmp_path, capsys, percents):
    code, out, err = _main(capsys, "heads", "prune", *percents, str(run), "--out", str(tmp_path), "--no-progress")
    assert code == 0, err
    _, rows = _csv(tmp_path / "curve.csv")
    assert [float(r["percent"]) for r in rows] == [10, 20, 30]
    assert err == ""  # --no-progress: no bar on stderr


def test_progress_bars_go_to_stderr_unless_switched_off(run, tmp_path, capsys):
    code, out, err = _main(capsys, "heads", "prune", str(run), "--percent", "50", "--out", str(tmp_path))
    assert code == 0 and "prune: 100%" in err and "prune:" not in out
    code, out, err = _main(capsys, "heads", "ablate", str(run), "--out", str(tmp_path), "--no-progress")
    assert code == 0 and err == "" and "ablation.csv" in out


def test_prune_curve(run, tmp_path):
    result = attnlab(
        "heads", "prune", str(run), "--percent", "0", "25", "50", "100", "--recompute", "--out", str(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    columns, rows = _csv(tmp_path / "curve.csv")
    assert columns == ["percent", "heads_pruned", "metric", "loss"]
    assert [int(r["heads_pruned"]) for r in rows] == [0, 3, 6, 12]
    assert (tmp_path / "curve.png").exists()


def test_physical_pruning_writes_a_smaller_run_with_the_same_outputs(run, tmp_path):
    out = tmp_path / "pruned"
    result = attnlab("heads", "prune", str(run), "--percent", "50", "--physical", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "inference on one batch" in result.stdout and "masked" in result.stdout and "pruned" in result.stdout
    pruned_heads = result.stdout.split("heads: ")[1].splitlines()[0].split(", ")
    smaller = open_run(out)
    assert smaller.model.num_parameters() < open_run(run).model.num_parameters()
    masked = json.loads(
        attnlab(
            "eval",
            str(run),
            "--split",
            "valid",
            "--json",
            "--no-progress",
            *[a for h in pruned_heads for a in ("--mask-head", h)],
        ).stdout
    )
    cut = json.loads(attnlab("eval", str(out), "--split", "valid", "--json", "--no-progress").stdout)
    assert cut["accuracy"] == masked["accuracy"]
    assert cut["loss"] == pytest.approx(masked["loss"], abs=1e-5)


def test_cli_head_mask_equals_zeroed_output_columns(run, tmp_path):
    masked = json.loads(
        attnlab("eval", str(run), "--split", "valid", "--json", "--no-progress", "--mask-head", "cross:1:0").stdout
    )
    copy = tmp_path / "zeroed"
    subprocess.run(["cp", "-r", str(run), str(copy)], check=True)
    loaded = open_run(copy)
    module = next(s.module for s in loaded.model.attention_sites() if (s.kind, s.layer) == ("cross", 1))
    with torch.no_grad():
        module.out_proj.weight[:, : module.d_v] = 0.0  # W^O columns of head 0
    (copy / "model.safetensors").unlink()
    loaded.run.save_weights(loaded.model)
    by_hand = json.loads(attnlab("eval", str(copy), "--split", "valid", "--json", "--no-progress").stdout)
    assert by_hand["accuracy"] == masked["accuracy"]
    assert by_hand["loss"] == pytest.approx(masked["loss"], abs=1e-6)


def test_training_with_heads_held_at_zero(tmp_path):
    config = {
        **EXPERIMENT,
        "train": {**EXPERIMENT["train"], "steps": 20, "mask_heads": ["cross:0:1", "encoder_self:1:0"]},
    }
    experiment = ExperimentConfig.from_dict(config)
    train(experiment, tmp_path / "run", progress=False)
    torch.manual_seed(experiment.train.seed)
    random.seed(experiment.train.seed)
    initial = model_for_task(experiment, build_task(experiment.task)[0])
    trained = open_run(tmp_path / "run").model
    for kind, layer, head in (("cross", 0, 1), ("encoder_self", 1, 0)):
        before = next(s.module for s in initial.attention_sites() if (s.kind, s.layer) == (kind, layer))
        after = next(s.module for s in trained.attention_sites() if (s.kind, s.layer) == (kind, layer))
        d = after.d_k
        for block in range(3):  # W^Q, W^K, W^V rows of the held head never moved
            rows = slice(block * after.heads * d + head * d, block * after.heads * d + (head + 1) * d)
            assert torch.equal(after.in_proj_weight[rows], before.in_proj_weight[rows])
        other = slice(0, d) if head == 1 else slice(d, 2 * d)
        assert not torch.equal(after.in_proj_weight[other], before.in_proj_weight[other])
    final = [r for r in RunDir.open(tmp_path / "run").read_metrics() if r.get("split") == "valid"][-1]
    reevaluated = json.loads(
        attnlab("eval", str(tmp_path / "run"), "--split", "valid", "--json", "--no-progress").stdout
    )
    assert reevaluated["loss"] == pytest.approx(final["loss"], abs=1e-6)  # the mask stays on in eval


HELD = ["cross:0:1", "encoder_self:1:0"]


@pytest.fixture(scope="module")
def held_run(tmp_path_factory) -> Path:
    """A run trained with two heads held at zero (train.mask_heads)."""
    path = tmp_path_factory.mktemp("held") / "run"
    train(
        ExperimentConfig.from_dict({**EXPERIMENT, "train": {**EXPERIMENT["train"], "steps": 30, "mask_heads": HELD}}),
        path,
        progress=False,
    )
    return path


def _eval(run: Path, *masked: str) -> dict:
    result = attnlab(
        "eval",
        str(run),
        "--split",
        "valid",
        "--json",
        "--no-progress",
        *[a for h in masked for a in ("--mask-head", h)],
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_heads_commands_start_from_the_held_heads_as_eval_does(held_run, tmp_path):
    """ablate's baseline and prune's 0% step are eval's numbers; held heads score 0 and are not counted."""
    expected = _eval(held_run)
    ablated = attnlab("heads", "ablate", str(held_run), "--kind", "cross", "--out", str(tmp_path))
    assert ablated.returncode == 0, ablated.stderr
    assert (
        f"with the held heads off: metric {expected['accuracy']:.4f} (valid accuracy), loss {expected['loss']:.4f}"
        in ablated.stdout
    )
    assert "cross:0:1, encoder_self:1:0" in ablated.stdout
    _, rows = _csv(tmp_path / "ablation.csv")
    held_row = next(r for r in rows if (r["kind"], r["layer"], r["head"]) == ("cross", "0", "1"))
    assert float(held_row["delta"]) == 0.0
    pruned = attnlab(
        "heads", "prune", str(held_run), "--percent", "0", "100", "--split", "valid", "--out", str(tmp_path)
    )
    assert pruned.returncode == 0, pruned.stderr
    _, curve = _csv(tmp_path / "curve.csv")
    assert [int(r["heads_pruned"]) for r in curve] == [0, 12 - len(HELD)]
    assert float(curve[0]["metric"]) == pytest.approx(expected["accuracy"], abs=1e-6)
    assert float(curve[0]["loss"]) == pytest.approx(expected["loss"], abs=1e-5)
    scored = attnlab("heads", "importance", str(held_run), "--out", str(tmp_path / "imp.csv"))
    assert scored.returncode == 0, scored.stderr
    _, importances = _csv(tmp_path / "imp.csv")
    by_head = {f"{r['kind']}:{r['layer']}:{r['head']}": float(r["importance"]) for r in importances}
    assert [name for name, value in by_head.items() if value == 0.0] == ["encoder_self:1:0", "cross:0:1"]


@pytest.mark.parametrize("kinds", [(), ("--kind", "cross")])
def test_physical_pruning_removes_held_heads_and_renumbers_the_rest(held_run, tmp_path, kinds):
    out = tmp_path / "pruned"
    result = attnlab("heads", "prune", str(held_run), "--percent", "30", "--physical", "--out", str(out), *kinds)
    assert result.returncode == 0, result.stderr
    pruned_heads = result.stdout.split("heads: ")[1].splitlines()[0].split(", ")
    smaller = open_run(out)
    if kinds:  # the held cross head is removed; the held encoder_self head stays held, in place
        assert "cross:0:1" in pruned_heads and all(h.startswith("cross:") for h in pruned_heads)
        assert smaller.experiment.train.mask_heads == ["encoder_self:1:0"]
    else:  # both held heads are removed, and 30% of the ten others (3)
        assert set(HELD) <= set(pruned_heads) and len(pruned_heads) == len(HELD) + 3
        assert smaller.experiment.train.mask_heads == []
    assert float(result.stdout.split("from the masked model: ")[1].split()[0]) < 1e-5
    masked = _eval(held_run, *pruned_heads)
    cut = _eval(out)
    assert cut["accuracy"] == masked["accuracy"]
    assert cut["loss"] == pytest.approx(masked["loss"], abs=1e-5)


def test_generate_decodes_with_the_held_heads_off(held_run):
    from attnlab.generate.search import decode
    from attnlab.head_ids import mask_without, parse_head

    loaded = open_run(held_run)
    task = loaded.task
    held = mask_without(loaded.model, [parse_head(spec, loaded.model) for spec in HELD])
    texts = [loaded.codec.decode(list(e.source[:-1])) for e in task.split("valid")[:12]]
    result = attnlab("generate", str(held_run), *texts, "--json")
    assert result.returncode == 0, result.stderr
    outputs = [json.loads(line)["output"] for line in result.stdout.splitlines()]
    expected, unmasked = [], []
    for text in texts:
        src = torch.tensor([loaded.codec.encode(text) + [task.eos_id]])
        for mask, into in ((held, expected), (None, unmasked)):
            tokens = decode(
                loaded.model, src, bos_id=task.bos_id, eos_id=task.eos_id, pad_id=task.pad_id, head_mask=mask
            )[0].tokens
            into.append(loaded.codec.decode(tokens))
    assert outputs == expected
    assert expected != unmasked  # the held heads change what is decoded, so the test can tell


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ("heads", "prune", "{run}", "--percent", "150"),
            "'150': Input should be less than or equal to 100",
        ),
        (
            ("heads", "prune", "{run}", "--percent", "-5"),
            "'-5': Input should be greater than or equal to 0",
        ),
        (
            ("heads", "prune", "{run}", "--percent", "10", "20", "--physical", "--out", "{tmp}/x"),
            "--physical: give exactly one --percent",
        ),
        (("heads", "prune", "{run}", "--percent", "10", "--physical"), "--physical: give --out NEW_RUN"),
        (
            ("heads", "ablate", "{run}", "--kind", "self"),
            "this run has no 'self' attention; it has: cross, decoder_self, encoder_self",
        ),
        (
            ("heads", "importance", "{run}", "--split", "dev"),
            "Invalid value for '--split': 'dev': 'dev' is not one of 'train', 'valid'",
        ),
        (("eval", "{run}", "--mask-head", "cross:0:5"), "head 5 is out of range; cross layer 0 has heads 0..1"),
        (("eval", "{run}", "--mask-head", "cross:9:0"), "layer 9 is out of range; cross has layers 0..1"),
        (("heads", "importance", "no/such/run"), "run not found"),
    ],
)
def test_bad_input(run, tmp_path, args, message):
    result = attnlab(*[a.format(run=run, tmp=tmp_path) for a in args])
    assert result.returncode == 2, result.stdout
    assert message in result.stderr and "Traceback" not in result.stderr
