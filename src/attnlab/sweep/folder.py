"""A sweep's folder: where its plan, runs, outcomes and report lie (see :mod:`attnlab.sweep`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from attnlab.errors import UsageError
from attnlab.run.storage import parse_json, read_bytes
from attnlab.sweep.plan import SweepPlan

__all__ = ["read_plan", "read_outcome"]

PLAN_FILE = "sweep.json"
RESULTS_FILE = "results.csv"
BY_LENGTH_FILE = "accuracy_by_length.csv"
SUMMARY_FILE = "summary.md"
PLOTS_FOLDER = "plots"
RUNS_FOLDER = "runs"
OUTCOMES_FOLDER = "outcomes"

OK, FAILED, DIVERGED, PENDING = "ok", "failed", "diverged", "pending"
"""How a run ended (its outcome's ``status``), or ``pending``: it has not."""


def read_plan(out: Path) -> SweepPlan:
    """The sweep recorded in ``out/sweep.json``.

    Raises:
        UsageError: no sweep there. DataError: the record is damaged.
    """
    path = Path(out) / PLAN_FILE
    if not path.exists():
        raise UsageError(f"{out}: not a sweep folder (no {PLAN_FILE})")
    return SweepPlan.from_json(
        parse_json(read_bytes(path, what="sweep record"), path=path, what="sweep record"), path=path
    )


def read_outcome(out: Path, name: str) -> dict[str, Any] | None:
    """How run ``name`` ended (``outcomes/NAME.json``); None when it has not (or the record is damaged)."""
    path = out / OUTCOMES_FOLDER / f"{name}.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # a damaged outcome: the run counts as interrupted
    return record if isinstance(record, dict) and "status" in record else None
