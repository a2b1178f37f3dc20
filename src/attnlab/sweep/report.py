"""A sweep's report: results.csv, accuracy_by_length.csv, summary.md and plots/, rebuilt from what
each run's metrics.jsonl holds, never recomputed (see :mod:`attnlab.sweep`).

Beside each split's accuracy over seeds the summary states the binomial standard error of one run's
figure, sqrt(p (1 - p) / n) at the seeds' mean p over the split's n strings, and how many seeds reach
the runs' ``horizon_threshold`` (0.95 unless the task sets another) on it. Every split is named
with its lengths (``length_generalisation (51-100)``; results.csv's ``SPLIT.lengths``), and a note
says what each kind of split is: where a length bin covers the lengths of ``length_generalisation``
the two are separate draws of strings. The generalisation horizon
(:mod:`attnlab.evaluation.horizon`) has a table of its own, and only ``length_bins`` is a horizon
there: from the longest training length over the consecutive held-out evaluations (mean ± std,
min–max over seeds, the seeds reaching its end). Each held-out split is then given on its own: the
seeds passing every length of it and the first failing length of the others (results.csv's
``SPLIT.passes`` and ``SPLIT.first_failing_length``, read from its accuracy per length), never its
lowest length − 1 as if that length had been reached.
``plots/accuracy_by_length_per_seed-COMBINATION.png`` draws each combination's accuracy by length over
its length bins, one line per seed, with the threshold; plot titles name each grid key in full
(``task.name=dyck1``).
"""

from __future__ import annotations

import csv
import io
import math
import re
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.ticker import MaxNLocator

from attnlab.evaluation.horizon import DEFAULT_THRESHOLD, binomial_se, first_failing_length
from attnlab.figures import plt, save_figure
from attnlab.run.directory import RunDir
from attnlab.run.storage import atomic_directory, atomic_write_text, ensure_folder
from attnlab.sweep.folder import (
    BY_LENGTH_FILE,
    DIVERGED,
    FAILED,
    OK,
    PENDING,
    PLOTS_FOLDER,
    RESULTS_FILE,
    RUNS_FOLDER,
    SUMMARY_FILE,
    read_outcome,
    read_plan,
)
from attnlab.sweep.plan import SweepPlan, SweepRun, name_part, seed_text

__all__ = ["collect_rows", "results_csv", "by_length_csv", "summary_statistics", "summary_markdown", "write_report"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _final_evaluations(records: Sequence[Mapping[str, Any]], step: int | None) -> dict[str, dict[str, Any]]:
    """Split -> the last evaluation record of the run's final step (the end-of-training evaluation)."""
    if step is None:
        steps = [r["step"] for r in records if _number(r.get("step"))]
        step = max(steps) if steps else None
    found: dict[str, dict[str, Any]] = {}
    for record in records:
        if isinstance(record.get("split"), str) and record.get("step") == step:
            found[record["split"]] = dict(record)
    return found


def _final_train_loss(records: Sequence[Mapping[str, Any]]) -> float | None:
    losses = [r["loss"] for r in records if "split" not in r and _number(r.get("loss"))]
    return float(losses[-1]) if losses else None


@dataclass(frozen=True)
class _RunReport:
    """One run as the report sees it: its row of results.csv, and accuracy and strings per length per split."""

    run: SweepRun
    row: dict[str, Any]
    by_length: dict[str, dict[int, float]]
    counts: dict[str, dict[int, int]]
    absent: dict[str, list[int]]


def _run_report(out: Path, plan: SweepPlan, run: SweepRun) -> _RunReport:
    outcome = read_outcome(out, run.name) or {}
    status = outcome.get("status", PENDING)
    row: dict[str, Any] = {"run": run.name, **run.labels, "seed": run.seed, "status": status}
    row["error"] = outcome.get("error") or ""
    by_length: dict[str, dict[int, float]] = {}
    counts: dict[str, dict[int, int]] = {}
    absent: dict[str, list[int]] = {}
    if status == OK:
        records = RunDir(out / RUNS_FOLDER / run.name).read_metrics()
        steps = outcome.get("steps")
        row["steps"] = steps
        row["final_loss"] = _final_train_loss(records)
        row["wall_s"] = outcome.get("wall_s")
        for split, record in _final_evaluations(records, steps).items():
            for key in ("accuracy", *sorted(record)):
                value = record.get(key)
                if key not in ("split", "step") and (isinstance(value, (bool, str)) or _number(value)):
                    row.setdefault(f"{split}.{key}", value)
            lengths = record.get("accuracy_by_length")
            if isinstance(lengths, Mapping):
                by_length[split] = {int(k): float(v) for k, v in lengths.items() if _number(v) and str(k).isdigit()}
            row.update(_split_lengths(split, record, by_length.get(split)))
            strings = record.get("examples_by_length")
            if isinstance(strings, Mapping):
                counts[split] = {int(k): int(v) for k, v in strings.items() if _number(v) and str(k).isdigit()}
            missing = record.get("absent_lengths")
            if isinstance(missing, list) and missing:
                absent[split] = [int(n) for n in missing if _number(n)]
    else:
        row["steps"] = outcome.get("steps")
        row["wall_s"] = outcome.get("wall_s")
    return _RunReport(run, row, by_length, counts, absent)


def _split_lengths(split: str, record: Mapping[str, Any], by_length: Mapping[int, float] | None) -> dict[str, Any]:
    """What a split's record says of its lengths, as ``SPLIT.lengths`` (``"51-100"``: the range of a
    split held out by length, else the lowest and highest length evaluated) and, for a split with a
    horizon, its own verdict: ``SPLIT.passes`` (every evaluated length reaches the threshold) and
    ``SPLIT.first_failing_length`` (the shortest that does not; None when it passes), read from its
    accuracy per length (``length_bins``, which has none: whether its horizon is its range's end)."""
    found: dict[str, Any] = {}
    span = record.get("length_range")
    if isinstance(span, list) and len(span) == 2 and all(_number(n) for n in span):
        found[f"{split}.lengths"] = f"{int(span[0])}-{int(span[1])}"
    elif by_length:
        found[f"{split}.lengths"] = f"{min(by_length)}-{max(by_length)}"
    threshold = record.get("horizon_threshold", DEFAULT_THRESHOLD)
    if not _number(record.get("horizon")) or not _number(threshold):
        return found
    if by_length is not None:
        failing = first_failing_length(by_length, float(threshold))
        found[f"{split}.passes"] = failing is None
        found[f"{split}.first_failing_length"] = failing
    elif isinstance(span, list) and len(span) == 2 and _number(span[1]):
        found[f"{split}.passes"] = record["horizon"] >= span[1]
    return found


def collect_rows(out: str | Path) -> tuple[SweepPlan, list[dict[str, Any]]]:
    """The sweep's plan and one results row per run (in plan order), read from the runs' files."""
    out = Path(out)
    plan = read_plan(out)
    return plan, [report.row for report in _collect(out, plan)]


def _collect(out: Path, plan: SweepPlan) -> list[_RunReport]:
    return [_run_report(out, plan, run) for run in plan.runs]


def _columns(plan: SweepPlan, rows: Sequence[Mapping[str, Any]]) -> list[str]:
    fixed = ["run", *plan.keys, "seed", "status", "error", "steps", "final_loss", "wall_s"]
    splits: list[str] = []
    metric_columns: dict[str, list[str]] = {}
    for row in rows:
        for column in row:
            if column in fixed or "." not in column or column in plan.keys:
                continue
            split, _, _ = column.partition(".")
            if split not in splits:
                splits.append(split)
            if column not in metric_columns.setdefault(split, []):
                metric_columns[split].append(column)
    ordered = [*fixed]
    for split in _split_order(splits):
        ordered += sorted(metric_columns[split], key=lambda c: (not c.endswith(".accuracy"), c))
    return ordered


def _split_order(splits: Iterable[str]) -> list[str]:
    """Splits in reading order: train, valid, test, length_generalisation, then the length bins (and
    ``length_bins``, the horizon over them), then the others (depth bins) by name."""
    first = ("train", "valid", "test", "length_generalisation")
    return sorted(
        set(splits),
        key=lambda s: (first.index(s) if s in first else len(first), not s.startswith("length_"), _natural(s)),
    )


def _natural(text: str) -> list[Any]:
    """Sort key putting ``length_13_24`` before ``length_100_200``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def results_csv(plan: SweepPlan, rows: Sequence[Mapping[str, Any]]) -> str:
    """``results.csv``: one row per run, every grid key, seed, status and the final metrics."""
    columns = _columns(plan, rows)
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow([_cell(row.get(column)) for column in columns])
    return buffer.getvalue()


def by_length_csv(plan: SweepPlan, reports: Sequence[_RunReport]) -> str:
    """``accuracy_by_length.csv``: one row per run, split and length (the evaluation's
    ``accuracy_by_length``), with the strings of that length (``examples``, empty for an evaluation
    that did not count them) and the accuracy's binomial standard error, for plots of one's own."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", *plan.keys, "seed", "split", "length", "accuracy", "examples", "se"])
    for report in reports:
        for split in _split_order(report.by_length):
            for length, accuracy in sorted(report.by_length[split].items()):
                labels = [report.run.labels[key] for key in plan.keys]
                n = report.counts.get(split, {}).get(length)
                se = "" if n is None else repr(binomial_se(accuracy, n))
                writer.writerow(
                    [report.run.name, *labels, report.run.seed, split, length, repr(accuracy), _cell(n), se]
                )
    return buffer.getvalue()


def summary_statistics(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, mean, sample standard deviation (n - 1 in the denominator; None below 2 values), min, max."""
    if not values:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {
        "n": len(values),
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else None,
        "min": min(values),
        "max": max(values),
    }


def _fmt(value: float | None) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4f}"


def summary_markdown(
    plan: SweepPlan, rows: Sequence[Mapping[str, Any]], absent: Mapping[str, Sequence[int]] | None = None
) -> str:
    """``summary.md``: per combination and split (named with its lengths), accuracy mean ± std and
    min–max over seeds, the horizon table and the held-out splits' own table, and the lengths without
    strings.

    Args:
        plan: the sweep.
        rows: one results row per run of ``plan``, in its order (:func:`collect_rows`).
        absent: split -> the lengths of its range without strings (said once), in the order
            given; a key may name the combinations it holds for (:func:`_absent_by_split`).

    Returns:
        The Markdown text.
    """
    keys = plan.keys
    by_combination: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for run, row in zip(plan.runs, rows):
        by_combination.setdefault(run.combination, []).append(row)
    splits = _split_order({c.partition(".")[0] for r in rows for c in r if c.endswith(".accuracy")})
    baseline = any(f"{s}.baseline_accuracy" in r for r in rows for s in splits)
    trained = any(isinstance(r.get(f"{s}.trained"), bool) for r in rows for s in splits)
    threshold = _threshold(rows)
    header = [*keys, "split", "accuracy (mean ± std)", "min–max", "n", "failed", "SE (one run)"]
    header += [f"seeds ≥ {threshold:g}"] + ["baseline"] * baseline + ["trained"] * trained
    grid = "; ".join(a.key + " = " + ", ".join(a.labels) for a in plan.axes)
    lines = [
        f"# Sweep of {plan.config_file}",
        "",
        f"Grid: {grid or 'none'}. "
        f"Seeds: {seed_text(plan.seeds)}." + (f" Fixed: {', '.join(plan.sets)}." if plan.sets else ""),
        "",
        "Accuracy of the end-of-training evaluation, per combination and split, over the seeds that "
        "finished: mean ± sample standard deviation (n − 1), min–max; n runs finished, failed runs "
        "(errors below and in results.csv); SE: the binomial standard error of one run's figure, "
        "sqrt(p (1 − p) / strings) at the mean p; the seeds whose accuracy reaches the threshold"
        + ("; baseline: the evaluation's baseline accuracy, mean" if baseline else "")
        + ("; trained: runs that fit their training split" if trained else "")
        + ".",
        "",
        *_splits_note(splits, rows),
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for combination, group in by_combination.items():
        ok_rows = [r for r in group if r["status"] == OK]
        failed = sum(r["status"] in (FAILED, DIVERGED) for r in group)
        shown = [s for s in splits if any(f"{s}.accuracy" in r for r in ok_rows)] or ["–"]
        for split in shown:
            values = [float(r[f"{split}.accuracy"]) for r in ok_rows if _number(r.get(f"{split}.accuracy"))]
            stats = summary_statistics(values)
            cells = [*combination, _split_label(split, ok_rows), f"{_fmt(stats['mean'])} ± {_fmt(stats['std'])}"]
            cells += [f"{_fmt(stats['min'])}–{_fmt(stats['max'])}", str(stats["n"]), str(failed)]
            strings = [r[f"{split}.examples"] for r in ok_rows if _number(r.get(f"{split}.examples"))]
            mean = stats["mean"]
            se = binomial_se(mean, round(statistics.fmean(strings))) if strings and mean is not None else None
            cells += [_fmt(se), f"{sum(v >= threshold for v in values)}/{len(values)}"]
            if baseline:
                base = [
                    float(r[f"{split}.baseline_accuracy"])
                    for r in ok_rows
                    if _number(r.get(f"{split}.baseline_accuracy"))
                ]
                cells.append(_fmt(statistics.fmean(base)) if base else "–")
            if trained:
                flags = [r[f"{split}.trained"] for r in ok_rows if isinstance(r.get(f"{split}.trained"), bool)]
                cells.append(f"{sum(flags)}/{len(flags)}" if flags else "–")
            lines.append("| " + " | ".join(cells) + " |")
    lines += _horizon_table(plan, by_combination)
    if absent:
        lines += ["", "Lengths without strings (the task has none of these lengths; not evaluated, not failed):", ""]
        lines += [f"- {split}: {', '.join(map(str, lengths))}" for split, lengths in absent.items()]
    problems = [r for r in rows if r["status"] in (FAILED, DIVERGED)]
    pending = [r for r in rows if r["status"] == PENDING]
    if problems:
        lines += ["", "## Failed runs", ""]
        lines += [f"- `{r['run']}` ({r['status']}): {r['error']}" for r in problems]
    if pending:
        lines += ["", f"{len(pending)} runs have not finished: {', '.join(r['run'] for r in pending)}."]
    return "\n".join(lines) + "\n"


def _threshold(rows: Sequence[Mapping[str, Any]]) -> float:
    """The accuracy a seed must reach to count: the runs' ``horizon_threshold`` (the first written),
    else :data:`~attnlab.evaluation.horizon.DEFAULT_THRESHOLD`."""
    found = (v for r in rows for c, v in r.items() if c.endswith(".horizon_threshold") and _number(v))
    return float(next(found, DEFAULT_THRESHOLD))


CHAIN = "length_bins"
"""The pseudo-split whose ``horizon`` is the one horizon of a run: from its longest training length
over the evaluations held out by length (:func:`attnlab.evaluation.horizon.chained_horizon`)."""


def _lengths(rows: Sequence[Mapping[str, Any]], split: str) -> str | None:
    """``"51-100"``: the lengths of ``split`` over ``rows`` (lowest to highest), None where no row says."""
    bounds = []
    for row in rows:
        low, dash, high = str(row.get(f"{split}.lengths", "")).partition("-")
        if dash and low.isdigit() and high.isdigit():
            bounds.append((int(low), int(high)))
    if not bounds:
        return None
    return f"{min(a for a, _ in bounds)}-{max(b for _, b in bounds)}"


def _split_label(split: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """``length_generalisation (51-100)``: a split named with its lengths (the name alone where no row says)."""
    lengths = _lengths(rows, split)
    return split if lengths is None else f"{split} ({lengths})"


def _splits_note(splits: Sequence[str], rows: Sequence[Mapping[str, Any]]) -> list[str]:
    """What each kind of split is, and, where a length bin spans the lengths of
    ``length_generalisation``, that the two are separate draws of the same lengths."""
    if not any(s == "length_generalisation" or _is_length_bin(s) for s in splits):
        return []
    ok = [r for r in rows if r.get("status") == OK]
    general = {r.get("length_generalisation.lengths") for r in ok} - {None}
    twins = [s for s in splits if _is_length_bin(s) and {r.get(f"{s}.lengths") for r in ok} & general]
    note = (
        "Splits, each named with its lengths (the range of a split held out by length, else the lengths "
        "evaluated): train, valid and test hold the training lengths; length_generalisation is the task's "
        "length-generalisation split (its own strings, `task.length_generalisation_size` of them)"
    )
    if any(_is_length_bin(s) for s in splits):
        note += "; length_A_B is a bin of `task.eval_lengths`, drawn apart"
    if twins:
        note += (
            f". {', '.join(twins)} and length_generalisation cover the same lengths but are two draws of "
            "strings, so their figures can differ by sampling"
        )
    return [note + ".", ""]


def _horizon_table(plan: SweepPlan, by_combination: Mapping[tuple[str, ...], list[Mapping[str, Any]]]) -> list[str]:
    """The summary's horizon tables: the runs' horizon (``length_bins``: mean ± std, min–max, the seeds
    reaching its end), then each split held out by length on its own: the seeds passing every length
    of it and where the others first fail, never its lowest length − 1 as if reached."""
    rows = [r for group in by_combination.values() for r in group if r["status"] == OK]
    splits = _split_order({c.partition(".")[0] for r in rows for c in r if c.endswith(".horizon")})
    if not splits:
        return []
    threshold = _threshold(rows)
    keys = list(plan.keys)
    lines: list[str] = []
    if CHAIN in splits:
        lines += [
            "",
            "## Generalisation horizon",
            "",
            f"The longest length up to which every evaluated length past the longest training length reaches "
            f"accuracy {threshold:g}, over the evaluations held out by length taken in order from it "
            "(length_generalisation first where the first bin starts right after it; lengths without strings "
            "are skipped); the longest training length itself where the first unseen length fails, or where the "
            "evaluations start past it. Over the seeds that finished: mean ± sample std, min–max; reaching the "
            "end: the seeds passing every length up to the last evaluated. This is the only horizon: the table "
            "after it gives each held-out split on its own.",
            "",
            "| "
            + " | ".join([*keys, "over lengths", "horizon (mean ± std)", "min–max", "reaching the end", "n"])
            + " |",
            "|" + "---|" * (len(keys) + 5),
        ]
        for combination, group in by_combination.items():
            ok = [r for r in group if r["status"] == OK]
            values = [float(r[f"{CHAIN}.horizon"]) for r in ok if _number(r.get(f"{CHAIN}.horizon"))]
            if not values:
                continue
            stats = summary_statistics(values)
            std = "–" if stats["std"] is None else f"{stats['std']:.1f}"
            ends = [r[f"{CHAIN}.passes"] for r in ok if isinstance(r.get(f"{CHAIN}.passes"), bool)]
            cells = [*combination, _lengths(ok, CHAIN) or "–", f"{stats['mean']:.1f} ± {std}"]
            cells += [f"{stats['min']:g}–{stats['max']:g}", f"{sum(ends)}/{len(ends)}" if ends else "–"]
            lines.append("| " + " | ".join([*cells, str(stats["n"])]) + " |")
    own = [s for s in splits if s != CHAIN]
    if own:
        lines += [
            "",
            "## Held-out splits on their own",
            "",
            f"Each split held out by length by itself, not a horizon: the seeds that pass it (every evaluated "
            f"length reaches {threshold:g}), and for the others the first length that does not, from the shortest "
            "(×k: k seeds); a split that starts past the first unseen length says nothing of the lengths before it.",
            "",
            "| " + " | ".join([*keys, "split", "passes", "first failing length (the other seeds)", "n"]) + " |",
            "|" + "---|" * (len(keys) + 4),
        ]
        for combination, group in by_combination.items():
            ok = [r for r in group if r["status"] == OK]
            for split in own:
                verdicts = [r for r in ok if isinstance(r.get(f"{split}.passes"), bool)]
                if not verdicts:
                    continue
                failing = sorted(
                    int(r[f"{split}.first_failing_length"])
                    for r in verdicts
                    if not r[f"{split}.passes"] and _number(r.get(f"{split}.first_failing_length"))
                )
                passes = sum(bool(r[f"{split}.passes"]) for r in verdicts)
                cells = [*combination, _split_label(split, ok), f"{passes}/{len(verdicts)}", _counted(failing)]
                lines.append("| " + " | ".join([*cells, str(len(verdicts))]) + " |")
    return lines


def _counted(lengths: Sequence[int]) -> str:
    """``[80, 102, 102]`` -> ``"80, 102 ×2"``; ``"–"`` for none."""
    if not lengths:
        return "–"
    return ", ".join(f"{n}" if lengths.count(n) == 1 else f"{n} ×{lengths.count(n)}" for n in sorted(set(lengths)))


def _is_length_bin(split: str) -> bool:
    return re.fullmatch(r"length_\d+_\d+", split) is not None


def _plot_per_seed(plan: SweepPlan, reports: Sequence[_RunReport], folder: Path, threshold: float) -> list[Path]:
    """One PNG per combination: accuracy against length over its length bins, one line per seed
    (a gap between bins breaks the line), with the threshold as a dashed line."""
    groups: dict[tuple[str, ...], list[_RunReport]] = {}
    for report in reports:
        if any(_is_length_bin(split) for split in report.by_length):
            groups.setdefault(report.run.combination, []).append(report)
    written = []
    for combination, group in groups.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for report in group:
            lengths: list[float] = []
            accuracies: list[float] = []
            previous_high = None
            for split in (s for s in _split_order(report.by_length) if _is_length_bin(s)):
                low, high = (int(part) for part in split.split("_")[1:])
                if previous_high is not None and low > previous_high + 1:  # lengths not evaluated
                    lengths.append(math.nan)
                    accuracies.append(math.nan)
                for n, a in sorted(report.by_length[split].items()):
                    lengths.append(n)
                    accuracies.append(a)
                previous_high = high
            ax.plot(lengths, accuracies, "o-", markersize=2, linewidth=1, label=f"seed {report.run.seed}")
        ax.axhline(threshold, color="grey", linestyle="--", linewidth=1, label=f"threshold {threshold:g}")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("length")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.02, 1.02)
        label = ", ".join(f"{k}={v}" for k, v in zip(plan.keys, combination)) or "all runs"
        ax.set_title(f"{label}: length bins, one line per seed")
        ax.legend(fontsize="small")
        fig.tight_layout()
        name = name_part("_".join(combination) or "all")
        written.append(save_figure(fig, folder / f"accuracy_by_length_per_seed-{name}.png", dpi=100))
    return written


def _plot_by_length(plan: SweepPlan, reports: Sequence[_RunReport], folder: Path) -> list[Path]:
    """One PNG per split: accuracy against length, one line per combination (mean over seeds),
    a band from the lowest to the highest seed."""
    splits = _split_order({split for report in reports for split in report.by_length})
    written = []
    for split in splits:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        groups: dict[tuple[str, ...], list[dict[int, float]]] = {}
        for report in reports:
            if split in report.by_length:
                groups.setdefault(report.run.combination, []).append(report.by_length[split])
        for combination, curves in groups.items():
            lengths = sorted({length for curve in curves for length in curve})
            values = [[curve[n] for curve in curves if n in curve] for n in lengths]
            label = ", ".join(f"{k}={v}" for k, v in zip(plan.keys, combination)) or "all runs"
            line = ax.plot(
                lengths, [statistics.fmean(v) for v in values], "o-", markersize=3, label=f"{label} (n={len(curves)})"
            )
            ax.fill_between(
                lengths, [min(v) for v in values], [max(v) for v in values], color=line[0].get_color(), alpha=0.2
            )
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("length")
        ax.set_ylabel(f"{split} accuracy")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{split}: mean over seeds, band min–max")
        ax.legend(fontsize="small")
        fig.tight_layout()
        written.append(save_figure(fig, folder / f"accuracy_by_length-{name_part(split)}.png", dpi=100))
    return written


def _absent_by_split(plan: SweepPlan, reports: Sequence[_RunReport]) -> dict[str, list[int]]:
    """Split -> its lengths without strings, in split order; where the combinations differ (a grid
    over tasks: Dyck-1 has no odd length, parity has every length), one entry per set of lengths,
    its key naming the combinations it holds for (``length_51_100 (task.name=dyck1)``)."""
    found: dict[str, dict[tuple[int, ...], list[tuple[str, ...]]]] = {}
    evaluated: dict[str, set[tuple[str, ...]]] = {}
    for report in reports:
        for split in report.by_length:
            evaluated.setdefault(split, set()).add(report.run.combination)
        for split, lengths in report.absent.items():
            holders = found.setdefault(split, {}).setdefault(tuple(lengths), [])
            if report.run.combination not in holders:
                holders.append(report.run.combination)
    absent: dict[str, list[int]] = {}
    for split in _split_order(found):
        for lengths, holders in found[split].items():
            if len(found[split]) == 1 and set(holders) >= evaluated.get(split, set()):
                absent[split] = list(lengths)
                continue
            absent[f"{split} ({_which(plan.keys, holders, evaluated.get(split, set()))})"] = list(lengths)
    return absent


def _which(keys: Sequence[str], holders: Sequence[tuple[str, ...]], among: set[tuple[str, ...]]) -> str:
    """The combinations ``holders`` in words: by the grid values they share where those pick out
    exactly them among ``among`` (``task.name=dyck1``), else each in full, ``;`` between."""
    shared = [(i, holders[0][i]) for i in range(len(keys)) if len({combo[i] for combo in holders}) == 1]
    picked = {combo for combo in among | set(holders) if all(combo[i] == value for i, value in shared)}
    if shared and picked == set(holders):
        return ", ".join(f"{keys[i]}={value}" for i, value in shared)
    return "; ".join(", ".join(f"{k}={v}" for k, v in zip(keys, combo)) for combo in holders) or "all runs"


def write_report(out: str | Path) -> list[Path]:
    """Rebuild ``results.csv``, ``accuracy_by_length.csv``, ``summary.md`` and ``plots/`` from the sweep's runs.

    Returns:
        The files written.

    Raises:
        UsageError: ``out`` is not a sweep folder. CheckpointError: a run's metrics are damaged.
    """
    out = Path(out)
    plan = read_plan(out)
    reports = _collect(out, plan)
    rows = [report.row for report in reports]
    # every file written (in a hidden folder inside OUT) before any replaces its old version: a full
    # disk leaves the last report whole (attnlab.run.storage.atomic_directory)
    with atomic_directory(out) as staging:
        atomic_write_text(staging / RESULTS_FILE, results_csv(plan, rows))
        atomic_write_text(staging / BY_LENGTH_FILE, by_length_csv(plan, reports))
        atomic_write_text(staging / SUMMARY_FILE, summary_markdown(plan, rows, _absent_by_split(plan, reports)))
        folder = ensure_folder(staging / PLOTS_FOLDER)
        per_seed = _plot_per_seed(plan, reports, folder, _threshold(rows))
        by_length = _plot_by_length(plan, reports, folder)
    plots = out / PLOTS_FOLDER
    drawn = [plots / path.name for path in [*by_length, *per_seed]]
    for old in [*plots.glob("accuracy_by_length-*.png"), *plots.glob("accuracy_by_length_per_seed-*.png")]:
        if old not in drawn:  # a plot of an earlier report that this one does not draw
            old.unlink()
    return [out / RESULTS_FILE, out / BY_LENGTH_FILE, out / SUMMARY_FILE, *drawn]
