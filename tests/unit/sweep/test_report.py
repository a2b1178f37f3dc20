"""attnlab.sweep.report without training: the summary of a plan read back from sweep.json."""

from __future__ import annotations

import dataclasses
import json

import pytest

from attnlab.sweep.plan import SweepPlan, plan_sweep
from attnlab.sweep.report import summary_markdown


def test_a_plan_read_back_keeps_the_grid_order_its_tables_use(config, tmp_path):
    """sweep.json stores each run's grid values as a sorted object; read back, they follow the
    axes again, so summary.md's cells sit under their own column (task.name after model.*, say)."""
    plan = plan_sweep(config, ["model.positional=sinusoidal,none", "model.attention=soft,hard"], "0")
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(plan.to_json(), sort_keys=True))
    read = SweepPlan.from_json(json.loads(path.read_text()), path=path)
    assert [run.combination for run in read.runs] == [run.combination for run in plan.runs]
    assert read.runs[1].combination == ("sinusoidal", "hard")
    rows = [{"run": run.name, "status": "ok", "valid.accuracy": 0.5} for run in read.runs]
    table = summary_markdown(read, rows)
    assert "| model.positional | model.attention | split |" in table
    assert "| sinusoidal | hard | valid |" in table and "| hard | sinusoidal |" not in table


def _section(table: str, heading: str) -> list[list[str]]:
    """The data rows (cells) of the table under ``## heading`` in a summary."""
    body = table.partition(f"## {heading}\n")[2].partition("\n## ")[0]
    rows = [
        [c.strip() for c in line.strip().strip("|").split("|")] for line in body.splitlines() if line.startswith("| ")
    ]
    return rows[1:]  # after the header


def _bins_rows(plan: SweepPlan) -> list[dict]:
    """Runs as the report reads them: with sinusoidal positions every seed fails inside
    length_generalisation (7-12) and so at the first length of the bin 13-24, whose own horizon is
    its floor, 12; without positions every seed passes both. A bin 7-12 covers length_generalisation's lengths."""
    rows = []
    for index, run in enumerate(plan.runs):
        passing = run.labels["model.positional"] == "none"
        row = {"run": run.name, "status": "ok", "length_bins.lengths": "7-24", "length_bins.horizon_threshold": 0.95}
        for split, lengths in (("length_generalisation", "7-12"), ("length_7_12", "7-12"), ("length_13_24", "13-24")):
            row[f"{split}.accuracy"] = 1.0 if passing else 0.3
            row[f"{split}.lengths"] = lengths
            row[f"{split}.horizon"] = int(lengths.split("-")[1]) if passing else 8 + index % 3
            row[f"{split}.passes"] = passing
            row[f"{split}.first_failing_length"] = None if passing else 9 + index % 3
        row["length_13_24.horizon"] = 24 if passing else 12  # the bin's floor, never reached
        row["length_13_24.first_failing_length"] = None if passing else (13 if index % 3 == 0 else 14)
        row["length_bins.horizon"] = 24 if passing else 8 + index % 3
        row["length_bins.passes"] = passing
        rows.append(row)
    return rows


def test_only_the_chained_horizon_is_a_horizon_and_a_bin_says_passes_or_its_first_failing_length(config):
    """The bin 13-24 of runs that all failed inside 7-12 reads 0 of 3 passing, first failing at 13
    and 14 (×2), never a horizon of 12.0 ± 0.0 as if its floor had been reached."""
    plan = plan_sweep(config, ["model.positional=sinusoidal,none"], "0-2")
    table = summary_markdown(plan, _bins_rows(plan))
    horizons = _section(table, "Generalisation horizon")
    assert horizons == [
        ["sinusoidal", "7-24", "9.0 ± 1.0", "8–10", "0/3", "3"],
        ["none", "7-24", "24.0 ± 0.0", "24–24", "3/3", "3"],
    ]
    own = {tuple(cells[:2]): cells[2:] for cells in _section(table, "Held-out splits on their own")}
    assert own[("sinusoidal", "length_13_24 (13-24)")] == ["0/3", "13, 14 ×2", "3"]
    assert own[("sinusoidal", "length_generalisation (7-12)")] == ["0/3", "9, 10, 11", "3"]
    assert own[("none", "length_13_24 (13-24)")] == ["3/3", "–", "3"]
    assert len(own) == 2 * 3 and not any("12.0" in "|".join(cells) for cells in own.values())


def test_every_split_is_named_with_its_lengths_and_two_draws_of_the_same_lengths_are_labelled(config):
    plan = plan_sweep(config, ["model.positional=sinusoidal,none"], "0-2")
    table = summary_markdown(plan, _bins_rows(plan))
    accuracy = table.partition("## ")[0]
    assert "| sinusoidal | length_generalisation (7-12) | 0.3000 ± 0.0000 |" in accuracy
    assert "| none | length_13_24 (13-24) | 1.0000 ± 0.0000 |" in accuracy
    assert "length_7_12 and length_generalisation cover the same lengths but are two draws of strings" in table
    # Without a bin over those lengths, no such note; a row without lengths keeps the bare name.
    rows = [{k: v for k, v in row.items() if not k.startswith("length_7_12")} for row in _bins_rows(plan)]
    for row in rows:
        del row["length_generalisation.lengths"]
    table = summary_markdown(plan, rows)
    assert "two draws" not in table and "| sinusoidal | length_generalisation | 0.3000" in table


def test_lengths_without_strings_name_the_combinations_they_hold_for(config):
    """A grid over tasks: one task has no odd lengths, the other has every length; the summary
    does not say the odd lengths are missing for both."""
    from attnlab.sweep.report import _absent_by_split, _RunReport, _which

    plan = plan_sweep(config, ["model.positional=sinusoidal,none"], "0-1")
    reports = [
        _RunReport(
            run,
            {"run": run.name, "status": "ok"},
            {"length_7_12": {8: 1.0, 10: 1.0}, "valid": {3: 1.0}},
            {},
            {"length_7_12": [7, 9, 11]} if run.labels["model.positional"] == "none" else {},
        )
        for run in plan.runs
    ]
    assert _absent_by_split(plan, reports) == {"length_7_12 (model.positional=none)": [7, 9, 11]}
    every = [dataclasses.replace(r, absent={"length_7_12": [7, 9, 11]}) for r in reports]
    assert _absent_by_split(plan, every) == {"length_7_12": [7, 9, 11]}
    table = summary_markdown(plan, [r.row for r in reports], _absent_by_split(plan, reports))
    assert "\n- length_7_12 (model.positional=none): 7, 9, 11\n" in table
    # Two keys: named by the value the holders share where it picks out exactly them, else each in full.
    plan = plan_sweep(config, ["model.positional=sinusoidal,none", "model.attention=soft,hard"], "0")
    combos = {run.combination for run in plan.runs}
    assert _which(plan.keys, [("none", "soft"), ("none", "hard")], combos) == "model.positional=none"
    named = _which(plan.keys, [("none", "soft"), ("sinusoidal", "hard")], combos)
    assert named == "model.positional=none, model.attention=soft; model.positional=sinusoidal, model.attention=hard"


def test_a_report_that_fails_midway_leaves_the_last_one_whole(config, tmp_path, monkeypatch):
    """Every file of a report is written before any replaces its old version (atomic_directory):
    a failed plot (a full disk, say) leaves the previous results.csv and summary.md as they were,
    and no temporary folder."""
    from attnlab.errors import ResourceError
    from attnlab.sweep import report
    from attnlab.sweep.folder import PLAN_FILE

    plan = plan_sweep(config, ["model.positional=sinusoidal,none"], "0")
    (tmp_path / PLAN_FILE).write_text(json.dumps(plan.to_json(), sort_keys=True))
    written = report.write_report(tmp_path)
    before = {path.name: path.read_bytes() for path in written}
    (tmp_path / "results.csv").write_text("the last report\n")

    def full_disk(*args, **kwargs):
        raise ResourceError("plots/x.png: cannot write: No space left on device (ENOSPC)")

    monkeypatch.setattr(report, "_plot_by_length", full_disk)
    with pytest.raises(ResourceError, match="ENOSPC"):
        report.write_report(tmp_path)
    assert (tmp_path / "results.csv").read_text() == "the last report\n"
    assert (tmp_path / "summary.md").read_bytes() == before["summary.md"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
