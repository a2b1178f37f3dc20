"""attnlab.sweep.report without training: the summary of a plan read back from sweep.json."""

from __future__ import annotations

import json

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
