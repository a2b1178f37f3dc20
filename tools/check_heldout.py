"""The held-out checks of docs/sweeps.md: what it states of a reproduction, rerun on seeds its
tables did not use.

    python tools/check_heldout.py --out sweeps/heldout              # every check
    python tools/check_heldout.py --out sweeps/heldout -k none      # only checks whose name holds a word
    python tools/check_heldout.py --out sweeps/heldout --jobs 2     # two trainings at once

Each check is one ``attnlab sweep`` of a paper's config (``configs/papers/``) over one cell of its
grid and the held-out seeds 10-14 (the tables use 0-9), into ``OUT/NAME``; the same command again
resumes the sweep and trains nothing already finished. Then each claim of the check is tested on
the sweep's ``results.csv`` rows, and printed with what was measured: ``holds`` or ``FAILS``.
Every claim tested held on seeds 0-9; docs/sweeps.md says which checks were run on the held-out
seeds for its text, and what they found. Figures that vary with the seed, such as how many seeds
reach length 150, are printed as measured, not tested.

Not part of ``make test``: a Bhattamishra et al. run takes 1.5-2 min of one core (it stops early
once it is right on every bin, else trains 1,500 steps), so a check of five seeds takes 7-10 min
of CPU and the whole set about 30 min on one core (``--jobs 2`` halves the wall time on two). Exit
code 0 when every claim checked holds, 1 when one fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SEEDS = "10-14"
"""The held-out seeds: none of them is in the tables of docs/sweeps.md (seeds 0-9)."""

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Claim:
    """One statement of docs/sweeps.md about a cell, and its test.

    Attributes:
        text: the statement, as the doc makes it.
        test: rows of the cell's runs -> (whether it holds, what was measured, in words).
    """

    text: str
    test: Callable[[Sequence[Row]], tuple[bool, str]]


@dataclass(frozen=True)
class Check:
    """One cell of a reproduction's grid rerun on the held-out seeds.

    Attributes:
        name: the check's name (its sweep folder under ``--out``).
        config: the paper's config, relative to the repository.
        grid: the ``--grid`` options that pick the cell.
        claims: what the doc states of the cell.
        measured: figures printed as measured, not tested (they vary with the seed): rows -> words.
    """

    name: str
    config: str
    grid: tuple[str, ...]
    claims: tuple[Claim, ...]
    measured: tuple[Callable[[Sequence[Row]], str], ...] = ()


def _every(rows: Sequence[Row], what: Callable[[Row], bool]) -> tuple[bool, int]:
    count = sum(bool(what(row)) for row in rows)
    return count == len(rows) and bool(rows), count


def _fits(rows: Sequence[Row]) -> tuple[bool, str]:
    holds, count = _every(rows, lambda r: r.get("valid.trained") is True)
    return holds, f"{count} of {len(rows)} fit (valid trained)"


def _fit_count(rows: Sequence[Row]) -> str:
    return _fits(rows)[1]


def _horizons(rows: Sequence[Row]) -> list[int]:
    return sorted(int(r["length_bins.horizon"]) for r in rows if isinstance(r.get("length_bins.horizon"), (int, float)))


def _past_training(rows: Sequence[Row]) -> tuple[bool, str]:
    """Every run right at every length of the first unseen ones: a horizon past 50."""
    found = _horizons(rows)
    return len(found) == len(rows) > 0 and min(found) > 50, f"horizons {', '.join(map(str, found))}"


def _first_length_fails(rows: Sequence[Row]) -> tuple[bool, str]:
    found = _horizons(rows)
    return len(found) == len(rows) > 0 and max(found) == 50, f"horizons {', '.join(map(str, found))}"


def _no_run_passes(split: str, lengths: str) -> Claim:
    def test(rows: Sequence[Row]) -> tuple[bool, str]:
        holds, count = _every(rows, lambda r: r.get(f"{split}.passes") is False)
        return holds, f"{len(rows) - count} of {len(rows)} pass every length of {lengths}"

    return Claim(f"no run is right (≥ 0.95) at every length of {lengths}", test)


def _reaching(rows: Sequence[Row]) -> str:
    found = _horizons(rows)
    return f"{sum(h == 150 for h in found)} of {len(found)} reach 150 (horizons {', '.join(map(str, found))})"


def _bin_means(rows: Sequence[Row]) -> str:
    def mean(split: str) -> str:
        values = [float(r[f"{split}.accuracy"]) for r in rows if isinstance(r.get(f"{split}.accuracy"), float)]
        return f"{sum(values) / len(values):.3f}" if values else "–"

    return f"mean accuracy 51-100 {mean('length_51_100')}, 101-150 {mean('length_101_150')}"


BHATTAMISHRA = "configs/papers/bhattamishra2020.toml"

CHECKS = (
    Check(
        "bhattamishra2020-dyck1-none",
        BHATTAMISHRA,
        ("task.name=dyck1", "model.positional=none"),
        (
            Claim("every run fits its training lengths", _fits),
            Claim("every run is right past its training lengths (horizon > 50)", _past_training),
        ),
        (_reaching, _bin_means),
    ),
    Check(
        "bhattamishra2020-dyck1-sinusoidal",
        BHATTAMISHRA,
        ("task.name=dyck1", "model.positional=sinusoidal"),
        (_no_run_passes("length_51_100", "51-100"), _no_run_passes("length_101_150", "101-150")),
        (_fit_count, _reaching, _bin_means),
    ),
    Check(
        "bhattamishra2020-dyck1-learned",
        BHATTAMISHRA,
        ("task.name=dyck1", "model.positional=learned"),
        (Claim("every run fails at the first unseen length (horizon 50)", _first_length_fails),),
        (_fit_count,),
    ),
)


def sweep_command(check: Check, out: Path, jobs: int) -> list[str]:
    """The ``attnlab sweep`` command of a check (run from the repository's root).

    Args:
        check: the check.
        out: the folder of every check's sweep.
        jobs: trainings at once.

    Returns:
        The command's arguments.
    """
    grid = [part for option in check.grid for part in ("--grid", option)]
    folder = str(out / check.name)
    return ["attnlab", "sweep", check.config, *grid, "--seeds", SEEDS, "--out", folder, "--jobs", str(jobs)]


def judge(check: Check, rows: Sequence[Row]) -> tuple[bool, list[str]]:
    """Test a check's claims on its runs' rows.

    Args:
        check: the check.
        rows: results rows (``attnlab.sweep.report.collect_rows``), failed runs included.

    Returns:
        Whether every claim holds (and every run finished), and one line per claim and figure.
    """
    finished = [row for row in rows if row.get("status") == "ok"]
    lines = [f"{check.name} (seeds {SEEDS}): {len(finished)} of {len(rows)} runs finished"]
    held = len(finished) == len(rows) > 0
    for claim in check.claims:
        holds, measured = claim.test(finished)
        held &= holds
        lines.append(f"  {'holds' if holds else 'FAILS'}: {claim.text} ({measured})")
    lines += [f"  measured: {figure(finished)}" for figure in check.measured]
    return held, lines


def main(argv: Sequence[str] | None = None) -> int:
    """Run the selected checks' sweeps, then test their claims.

    Args:
        argv: the command line (``sys.argv[1:]`` by default).

    Returns:
        The exit code: 0 when every claim holds, 1 when one fails, 2 on a usage error.
    """
    parser = argparse.ArgumentParser(description=__doc__.partition("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder of the checks' sweeps (kept, to resume)")
    parser.add_argument("-k", action="append", default=[], help="only checks whose name holds this word")
    parser.add_argument("--jobs", type=int, default=1, help="trainings at once (attnlab sweep --jobs)")
    args = parser.parse_args(argv)
    chosen = [c for c in CHECKS if not args.k or any(word in c.name for word in args.k)]
    if args.jobs < 1:
        print(f"error: --jobs must be >= 1, got {args.jobs}", file=sys.stderr)
        return 2
    if not chosen:
        print(f"error: no check named {args.k} (checks: {', '.join(c.name for c in CHECKS)})", file=sys.stderr)
        return 2
    from attnlab.sweep.report import collect_rows

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    failed = False
    for check in chosen:
        started = time.perf_counter()
        command = sweep_command(check, args.out.resolve(), args.jobs)
        done = subprocess.run([sys.executable, "-m", *command, "--no-progress"], cwd=ROOT, env=env, check=False)
        if done.returncode != 0:
            print(f"{check.name}: attnlab sweep exited with {done.returncode}", file=sys.stderr)
            failed = True
            continue
        held, lines = judge(check, collect_rows(args.out.resolve() / check.name)[1])
        print("\n".join(lines) + f"\n  ({time.perf_counter() - started:.0f} s)", flush=True)
        failed |= not held
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
