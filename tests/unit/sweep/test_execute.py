"""attnlab.sweep.execute (and the report it writes): a grid x seeds of tiny parity runs, resume,
--jobs, failures recorded.

The sweeps train in worker processes (spawned: each imports torch once), so the module fixture
trains its 8 runs once with 2 workers and once with 1, and the tests read what they wrote.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from attnlab.errors import UsageError
from attnlab.run.directory import RunDir
from attnlab.sweep.execute import run_sweep
from attnlab.sweep.folder import OUTCOMES_FOLDER, PLAN_FILE, RUNS_FOLDER
from attnlab.sweep.plan import plan_sweep
from attnlab.sweep.report import write_report
from tests.unit.sweep.tiny import GRID


@pytest.fixture(scope="module")
def swept(config, tmp_path_factory) -> dict:
    """The 2 x 2 grid with seeds 0-1 trained with --jobs 2; three of its runs again with --jobs 1."""
    plan = plan_sweep(config, GRID, "0-1")
    some = dataclasses.replace(plan, runs=plan.runs[1::3])  # one of each seed and attention
    two = tmp_path_factory.mktemp("jobs2") / "sweep"
    one = tmp_path_factory.mktemp("jobs1") / "sweep"
    return {
        "plan": plan,
        "some": some,
        "two": two,
        "one": one,
        "result_two": run_sweep(plan, two, jobs=2),
        "result_one": run_sweep(some, one, jobs=1),
    }


def _csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def _rows(folder: Path) -> list[dict[str, str]]:
    return _csv(folder / "results.csv")


def _summary_cells(folder: Path) -> dict[tuple[str, str, str], list[str]]:
    """(attention, positional, split) -> the other cells of summary.md's first table's row."""
    cells = {}
    for line in (folder / "summary.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):  # the horizon table and the failures follow the accuracy table
            break
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if line.startswith("| ") and parts[0] in ("soft", "hard"):
            cells[(*parts[:2], parts[2].partition(" (")[0])] = parts[3:]  # the split without its lengths
    return cells


def test_the_grid_times_the_seeds_is_eight_runs_with_a_row_each(swept):
    plan, folder = swept["plan"], swept["two"]
    assert len(plan.runs) == 8
    assert swept["result_two"].ok == 8 and swept["result_two"].failed == 0
    rows = _rows(folder)
    assert [row["run"] for row in rows] == [run.name for run in plan.runs]
    combos = {(row["model.attention"], row["model.positional"], row["seed"]) for row in rows}
    assert combos == {(a, p, s) for a in ("soft", "hard") for p in ("sinusoidal", "none") for s in ("0", "1")}
    for row in rows:
        assert row["status"] == "ok" and row["steps"] == "4"
        path = folder / RUNS_FOLDER / row["run"]
        config = RunDir.open(path).read_config()
        assert config["model"]["attention"] == row["model.attention"]
        assert config["model"]["positional"] == row["model.positional"]
        assert config["train"]["seed"] == int(row["seed"]) == config["task"]["seed"]  # a seed sets both
        assert config["train"]["threads"] == 1
        records = RunDir.open(path).read_metrics()
        final = [r for r in records if r.get("split") == "valid" and r["step"] == 4][-1]
        assert float(row["valid.accuracy"]) == final["accuracy"]  # read from the run, not recomputed
        assert float(row["final_loss"]) == [r["loss"] for r in records if "split" not in r][-1]
        assert float(row["wall_s"]) > 0
        by_length = {
            (r["length"], float(r["accuracy"]))
            for r in _csv(folder / "accuracy_by_length.csv")
            if r["run"] == row["run"] and r["split"] == "valid"
        }
        assert by_length == {(k, v) for k, v in final["accuracy_by_length"].items()}
        # The sweep's train.final_splits: test and length_generalisation scored after the last step.
        for split in ("test", "length_generalisation"):
            (scored,) = [r for r in records if r.get("split") == split]
            assert scored["step"] == 4 and float(row[f"{split}.accuracy"]) == scored["accuracy"]


def test_summary_has_mean_std_min_max_of_the_rows(swept):
    folder = swept["two"]
    rows = _rows(folder)
    cells = _summary_cells(folder)
    assert len(cells) == 4 * 3  # combinations x (valid, test, length_generalisation)
    for attention, positional, split in cells:
        assert split in ("valid", "test", "length_generalisation")
        values = np.array(
            [
                float(r[f"{split}.accuracy"])
                for r in rows
                if r["model.attention"] == attention and r["model.positional"] == positional
            ],
            dtype=np.float64,
        )
        mean_std, span, n, failed = cells[(attention, positional, split)][:4]  # then baseline, trained if any
        mean, std = (float(x) for x in mean_std.split(" ± "))
        low, high = (float(x) for x in span.split("–"))
        assert mean == pytest.approx(values.mean(), abs=5e-5)
        assert std == pytest.approx(values.std(ddof=1), abs=5e-5)
        assert (low, high) == (pytest.approx(values.min(), abs=5e-5), pytest.approx(values.max(), abs=5e-5))
        assert (n, failed) == ("2", "0")


def test_jobs_two_gives_the_results_of_jobs_one(swept):
    two = {row["run"]: row for row in _rows(swept["two"])}
    one = _rows(swept["one"])
    assert len(one) == 3
    keep = ("run", "status", "steps", "final_loss", "valid.accuracy", "valid.loss")
    assert [{k: two[r["run"]][k] for k in keep} for r in one] == [{k: r[k] for k in keep} for r in one]


def test_the_plot_is_written_per_split(swept):
    picture = swept["two"] / "plots" / "accuracy_by_length-valid.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_rebuilds_identical_files(swept):
    folder = swept["two"]
    names = ["results.csv", "accuracy_by_length.csv", "summary.md", "plots/accuracy_by_length-valid.png"]
    before = {name: (folder / name).read_bytes() for name in names}
    for name in names:
        (folder / name).unlink()
    write_report(folder)
    assert {name: (folder / name).read_bytes() for name in names} == before


def test_every_split_the_evaluation_wrote_is_reported_with_its_baseline_and_trained_flag(swept, tmp_path):
    """Evaluations of more splits (length bins), with a baseline and a trained flag, as later
    evaluations write them: columns per split, and the summary's baseline mean and trained count."""
    folder = tmp_path / "sweep"
    shutil.copytree(swept["two"], folder)
    for index, run in enumerate(swept["plan"].runs):
        extra = [
            {
                "split": "length_9_12",
                "step": 4,
                "accuracy": index / 8,
                "baseline_accuracy": 0.5,
                "trained": index % 2 == 0,
            },
            {"split": "length_5_8", "step": 4, "accuracy": 1 - index / 8, "accuracy_by_length": {"5": 1.0, "8": 0.25}},
            {"split": "length_5_8", "step": 2, "accuracy": 0.0},  # an earlier evaluation: not the final one
        ]
        with open(folder / RUNS_FOLDER / run.name / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in extra)
    write_report(folder)
    rows = _rows(folder)
    columns = list(rows[0])
    assert (
        columns.index("valid.accuracy") < columns.index("length_5_8.accuracy") < columns.index("length_9_12.accuracy")
    )
    assert [float(r["length_9_12.accuracy"]) for r in rows] == [i / 8 for i in range(8)]
    assert [r["length_9_12.trained"] for r in rows] == ["true", "false"] * 4
    cells = _summary_cells(folder)
    # soft/sinusoidal holds runs 0 and 1: accuracies 0 and 1/8, one of them trained.
    assert cells[("soft", "sinusoidal", "length_9_12")] == [
        "0.0625 ± 0.0884",
        "0.0000–0.1250",
        "2",
        "0",
        "–",  # no strings counted in these hand-made records: no standard error
        "0/2",
        "0.5000",
        "1/2",
    ]
    # The final valid record carries the trained flag the end of training wrote: counted as written.
    valid_flags = [_final_valid(folder / RUNS_FOLDER / run.name)["trained"] for run in swept["plan"].runs[:2]]
    assert cells[("soft", "sinusoidal", "valid")][-1] == f"{sum(valid_flags)}/2"
    assert (folder / "plots" / "accuracy_by_length-length_5_8.png").exists()


def _final_valid(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]
    return [r for r in records if r.get("split") == "valid"][-1]


def test_a_resume_skips_finished_runs(swept):
    folder, plan = swept["two"], swept["plan"]
    stamps = {p: p.stat().st_mtime_ns for p in (folder / RUNS_FOLDER).rglob("*") if p.is_file()}
    result = run_sweep(plan, folder, jobs=2)
    assert (result.trained, result.skipped, result.ok) == (0, 8, 8)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps  # no run file was touched


def test_an_interrupted_run_resumes_from_its_checkpoint_and_one_without_starts_over(config, tmp_path):
    plan = plan_sweep(config, ["model.attention=soft,hard"], "1")
    folder = tmp_path / "sweep"
    first = run_sweep(plan, folder, jobs=1)
    assert first.ok == 2
    expected = _rows(folder)
    resumed, restarted = plan.runs[0].name, plan.runs[1].name
    (folder / OUTCOMES_FOLDER / f"{resumed}.json").unlink()  # killed after its last checkpoint
    (folder / OUTCOMES_FOLDER / f"{restarted}.json").unlink()  # killed before its first checkpoint
    run = folder / RUNS_FOLDER / restarted
    for item in ("checkpoints", "checkpoint.json", "model.safetensors", "manifest.json"):
        path = run / item
        path.unlink() if path.is_file() else shutil.rmtree(path)
    result = run_sweep(plan, folder, jobs=1)
    assert (result.trained, result.skipped) == (2, 0)
    outcome = json.loads((folder / OUTCOMES_FOLDER / f"{resumed}.json").read_text())
    assert outcome["resumed"] is True and outcome["status"] == "ok"
    outcome = json.loads((folder / OUTCOMES_FOLDER / f"{restarted}.json").read_text())
    assert outcome["resumed"] is False and outcome["status"] == "ok"
    keep = ("run", "status", "steps", "final_loss", "valid.accuracy")
    assert [{k: r[k] for k in keep} for r in _rows(folder)] == [{k: r[k] for k in keep} for r in expected]


def test_a_resume_with_another_grid_is_refused(swept, config):
    folder = swept["two"]
    stamp = (folder / PLAN_FILE).stat().st_mtime_ns
    with pytest.raises(UsageError, match=r"another grid \(model\.attention=soft,hard, not soft\)"):
        run_sweep(plan_sweep(config, ["model.attention=soft", GRID[1]], "0-1"), folder)
    with pytest.raises(UsageError, match=r"other seeds \(0,1, not 0,1,3\)"):
        run_sweep(plan_sweep(config, GRID, "0,1,3"), folder)
    with pytest.raises(UsageError, match=r"train\.lr \(0\.001 recorded, 0\.002 now\)"):
        run_sweep(plan_sweep(config, GRID, "0-1", ["train.lr=2e-3"]), folder)
    assert (folder / PLAN_FILE).stat().st_mtime_ns == stamp


def test_a_failed_run_is_recorded_and_the_others_finish(config, tmp_path):
    plan = plan_sweep(config, ["train.lr=0.001,1e9"], "0", ['train.schedule="constant"'])
    folder = tmp_path / "sweep"
    result = run_sweep(plan, folder, jobs=1)
    assert (result.ok, result.failed) == (1, 1)
    rows = {row["train.lr"]: row for row in _rows(folder)}
    assert rows["0.001"]["status"] == "ok" and rows["0.001"]["valid.accuracy"]
    assert rows["1e9"]["status"] == "diverged"
    assert re.fullmatch(r"the loss became nan at step \d+; .*", rows["1e9"]["error"])
    assert rows["1e9"]["valid.accuracy"] == ""
    summary = (folder / "summary.md").read_text()
    assert "| 1e9 | – | – ± – | –––" in summary and "| 0 | 1 |" in summary
    assert f"`{rows['1e9']['run']}` (diverged): the loss became nan" in summary
    again = run_sweep(plan, folder, jobs=1)  # a failed run is not repeated ...
    assert (again.trained, again.failed) == (0, 1)
    again = run_sweep(plan, folder, jobs=1, retry_failed=True)  # ... unless asked
    assert (again.trained, again.failed) == (1, 1)


def _section_cells(folder: Path, heading: str, width: int) -> dict[tuple[str, ...], list[str]]:
    """The first ``width`` cells -> the others, of each row of summary.md's table under ``## heading``."""
    text = (folder / "summary.md").read_text(encoding="utf-8")
    table = text.partition(f"## {heading}\n")[2].partition("\n## ")[0]
    cells = {}
    for line in table.splitlines():
        parts = [part.strip() for part in line.strip().strip("|").split("|")]
        if line.startswith("| ") and parts[0] in ("soft", "hard"):
            cells[tuple(parts[:width])] = parts[width:]
    return cells


def test_horizons_seed_counts_and_standard_errors_are_aggregated_over_seeds(swept, tmp_path):
    """Hand-made bin evaluations (as the end of training writes them): the horizon's mean ± std,
    min–max and n per combination, the seeds reaching the threshold and the binomial standard
    error beside the bin's accuracy, strings and standard error per length, a plot per combination."""
    folder = tmp_path / "sweep"
    shutil.copytree(swept["two"], folder)
    for index, run in enumerate(swept["plan"].runs):
        accuracy, reached = (0.96, 26) if index % 2 == 0 else (0.5, 34)
        extra = [
            {
                "split": "length_21_40",
                "step": 4,
                "accuracy": accuracy,
                "examples": 400,
                "horizon": reached,
                "horizon_threshold": 0.95,
                "accuracy_by_length": {"22": 1.0, "24": accuracy},
                "examples_by_length": {"22": 200, "24": 200},
                "absent_lengths": [21, 23],
                "length_range": [21, 40],
            },
            {
                "split": "length_bins",
                "step": 4,
                "horizon": 40 if index == 0 else reached + index,
                "horizon_threshold": 0.95,
                "length_range": [7, 40],
            },
        ]
        with open(folder / RUNS_FOLDER / run.name / "metrics.jsonl", "a", encoding="utf-8") as handle:
            handle.writelines(json.dumps(record) + "\n" for record in extra)
    write_report(folder)
    # soft/sinusoidal holds runs 0 and 1: accuracies 0.96 and 0.5, horizons 26 and 34 (bins: 26, 35).
    cells = _summary_cells(folder)[("soft", "sinusoidal", "length_21_40")]
    mean_std, span, n, failed, se, reaching = cells[:6]
    assert (mean_std, span, n, failed, reaching) == ("0.7300 ± 0.3253", "0.5000–0.9600", "2", "0", "1/2")
    assert float(se) == pytest.approx((0.73 * 0.27 / 400) ** 0.5, abs=5e-5)
    # The one horizon, length_bins (runs 0 and 1: 40, the end of its lengths, and 35) ...
    horizons = _section_cells(folder, "Generalisation horizon", 2)
    assert horizons[("soft", "sinusoidal")] == ["7-40", "37.5 ± 3.5", "35–40", "1/2", "2"]
    assert len(horizons) == 4
    # ... and each held-out split on its own: passing seeds, the others' first failing length (24 at 0.5).
    own = _section_cells(folder, "Held-out splits on their own", 3)
    assert own[("soft", "sinusoidal", "length_21_40 (21-40)")] == ["1/2", "24", "2"]
    assert {split for _, _, split in own} == {"length_21_40 (21-40)", "length_generalisation (7-12)"}
    rows = _rows(folder)
    assert [float(r["length_bins.horizon"]) for r in rows] == [40] + [
        26 + i if i % 2 == 0 else 34 + i for i in range(1, 8)
    ]
    assert [r["length_bins.passes"] for r in rows] == ["true"] + ["false"] * 6 + ["true"]  # 40 and 41 reach 40
    assert [r["length_21_40.first_failing_length"] for r in rows] == ["", "24"] * 4
    assert {(r["length_21_40.lengths"], r["length_bins.lengths"]) for r in rows} == {("21-40", "7-40")}
    per_length = [r for r in _csv(folder / "accuracy_by_length.csv") if r["split"] == "length_21_40"]
    assert {(r["length"], r["examples"]) for r in per_length} == {("22", "200"), ("24", "200")}
    odd = next(r for r in per_length if r["length"] == "24" and r["accuracy"] == "0.5")
    assert float(odd["se"]) == pytest.approx((0.25 / 200) ** 0.5)
    assert "\n- length_21_40: 21, 23\n" in (folder / "summary.md").read_text(encoding="utf-8")
    plots = sorted(p.name for p in (folder / "plots").glob("accuracy_by_length_per_seed-*.png"))
    assert plots == [
        f"accuracy_by_length_per_seed-{a}_{p}.png" for a in ("hard", "soft") for p in ("none", "sinusoidal")
    ]


def test_plot_titles_and_legends_name_each_grid_key_in_full(swept, tmp_path, monkeypatch):
    from attnlab.sweep import report

    folder = tmp_path / "sweep"
    shutil.copytree(swept["two"], folder)
    texts: list[str] = []
    real = report.save_figure

    def keep_texts(fig, path, **options):
        (ax,) = fig.axes
        texts.extend([ax.get_title(), *ax.get_legend_handles_labels()[1]])
        return real(fig, path, **options)

    monkeypatch.setattr(report, "save_figure", keep_texts)
    write_report(folder)
    assert "model.attention=soft, model.positional=sinusoidal (n=2)" in texts
    assert not any(re.search(r"(^|[ ,])(attention|positional)=", text) for text in texts)


def test_a_sweep_recorded_with_short_run_names_resumes_and_reports_under_them(swept, tmp_path):
    """A sweep written before run names carried full keys (``attention-soft_positional-none_seed-0``):
    the same command resumes it in its own folders, and the report reads them."""
    folder = tmp_path / "sweep"
    shutil.copytree(swept["two"], folder)
    record = json.loads((folder / PLAN_FILE).read_text(encoding="utf-8"))
    old_names = {}
    for run in record["runs"]:
        old = run["name"].replace("model.", "")
        assert old != run["name"]
        (folder / RUNS_FOLDER / run["name"]).rename(folder / RUNS_FOLDER / old)
        (folder / OUTCOMES_FOLDER / f"{run['name']}.json").rename(folder / OUTCOMES_FOLDER / f"{old}.json")
        old_names[run["name"]], run["name"] = old, old
    (folder / PLAN_FILE).write_text(json.dumps(record), encoding="utf-8")
    interrupted = record["runs"][0]["name"]
    (folder / OUTCOMES_FOLDER / f"{interrupted}.json").unlink()  # killed after its last checkpoint
    result = run_sweep(swept["plan"], folder, jobs=1)
    assert (result.trained, result.skipped, result.ok) == (1, 7, 8)
    assert json.loads((folder / OUTCOMES_FOLDER / f"{interrupted}.json").read_text())["resumed"] is True
    assert sorted(p.name for p in (folder / RUNS_FOLDER).iterdir()) == sorted(old_names.values())
    assert [r["run"] for r in _rows(folder)] == [old_names[run.name] for run in swept["plan"].runs]
    assert all(r["status"] == "ok" and r["valid.accuracy"] for r in _rows(folder))
