"""Sweeps: one config trained over a grid of keys and seeds, then results over seeds.

A single run misleads (Dyck-1 with sinusoidal positions scored 0.81 on the length-generalisation
split with seed 0 and 0.42 with seed 2); the papers that test what self-attention can recognise
(Bhattamishra et al. 2020; Delétang et al. 2023; Ruoss et al. 2023) report tables over seeds. A
sweep is the product of its grids and its seeds::

    attnlab sweep configs/dyck1.toml --grid model.positional=sinusoidal,learned,none \\
        --grid model.attention=soft,hard --seeds 0-4 --out sweeps/dyck1 --jobs 2

Every run's config is ``CONFIG.toml``, then the sweep's defaults (``train.threads = 1``,
``train.final_splits = ["test", "length_generalisation"]``), then
``--set`` (as ``attnlab train --set``), then its grid values, then its seed: a seed sets
``train.seed`` and, where the task has one, ``task.seed``. All of them are built and checked, as
``attnlab train`` checks one (keys, values, the task, the model config, the memory estimate),
before anything is written.

A config file may carry its own grid and seeds in a ``[sweep]`` table (what
``configs/papers/`` do), so that ``attnlab sweep FILE --out DIR`` alone reproduces a table::

    [sweep]
    seeds = "0-2"
    [sweep.grid]
    "model.positional" = ["none", "sinusoidal", "learned"]
    "task.name" = ["dyck1", "parity"]

``--grid KEY=...`` on the command line replaces that key's values (or adds a key), ``--seeds``
replaces the seeds. ``attnlab train FILE`` ignores the table and trains the file's base config.

The sweep folder ``DIR`` holds:

* ``sweep.json``: the config file's tables, ``--set``, the grid, the seeds and each run's resolved
  config. Running the sweep again with the same ``--out`` resumes it; a different grid, seed list,
  ``--set`` or config is refused.
* ``runs/NAME/``: one ordinary run directory per run (``attnlab eval DIR/runs/NAME`` works), named
  from its grid values and seed, e.g. ``positional-learned_attention-hard_seed-3``.
* ``outcomes/NAME.json``: how the run ended: ``ok``, ``failed`` or ``diverged`` with its error line,
  its steps and the wall time of the session that finished it. A run with an outcome is not run
  again (``retry_failed`` re-runs the failed ones); a run folder without one was interrupted: it
  resumes from its last checkpoint through the trainer's resume, or starts over if it has none.
* ``results.csv`` (one row per run: grid values, seed, status, error, steps, final training loss,
  wall time, and every number the end-of-training evaluation wrote per split: ``valid.accuracy``,
  ``length_13_24.accuracy``, ...), ``accuracy_by_length.csv`` (run, split, length, accuracy),
  ``summary.md`` (per combination and split: mean ± sample std, min–max over seeds, runs finished
  and failed) and ``plots/accuracy_by_length-SPLIT.png``, all rebuilt from the runs by
  :func:`write_report` from what each run's ``metrics.jsonl`` holds, never recomputed.

With ``jobs = 1`` the runs train one after another in this process; with ``jobs = N > 1`` in N
worker processes (spawned; each trains one run at a time on its ``train.threads``, imports PyTorch
once and trains many runs). Either way a run that fails is recorded and the others go on, and a
run's numbers do not depend on ``jobs``: every run seeds itself from its config.
"""

from __future__ import annotations

import csv
import io
import json
import math
import multiprocessing
import re
import shutil
import statistics
import time
import tomllib
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError, AttnlabWarning, ConfigError, DataError, UsageError

__all__ = [
    "GridAxis",
    "SweepRun",
    "SweepPlan",
    "SweepResult",
    "parse_grid",
    "parse_seeds",
    "plan_sweep",
    "sweep_table",
    "run_sweep",
    "write_report",
    "summary_statistics",
]

PLAN_FILE = "sweep.json"
RESULTS_FILE = "results.csv"
BY_LENGTH_FILE = "accuracy_by_length.csv"
SUMMARY_FILE = "summary.md"
PLOTS_FOLDER = "plots"
RUNS_FOLDER = "runs"
OUTCOMES_FOLDER = "outcomes"
PLAN_FORMAT = 1

SWEEP_DEFAULTS = ("train.threads=1", 'train.final_splits=["test", "length_generalisation"]')
"""Set on every run before ``--set``: one thread per training, so that ``jobs`` runs share the
cores without oversubscription and a run's numbers do not depend on ``jobs``; and the test and
length-generalisation splits scored after the last step, beside valid and the length bins, so that
the report has every split."""

OK, FAILED, DIVERGED, PENDING = "ok", "failed", "diverged", "pending"

MAX_RUNS = 10_000
"""The most runs one sweep may hold (a grid typo such as ``--seeds 0-100000`` is refused)."""

MAX_WORKER_DEATHS = 2
"""A run whose worker process died this many times (killed, out of memory) is recorded as failed."""


# ---- the plan ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridAxis:
    """One ``--grid section.key=v1,v2,...``.

    Attributes:
        key: ``section.key``.
        values: the values, read as TOML like ``--set`` values.
        labels: the values as written, used in run names and tables.
        origin: where the axis was given (``--grid`` or the file's ``[sweep] grid``), for errors.
    """

    key: str
    values: tuple[Any, ...]
    labels: tuple[str, ...]
    origin: str = field(default="--grid", compare=False)


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: a value of every grid key and a seed.

    Attributes:
        name: the run's folder name under ``runs/`` (stable: made from the labels and the seed).
        labels: grid key -> the value's label, in grid order.
        seed: ``train.seed`` (and ``task.seed`` where the task has one).
        config: the run's resolved config (``ExperimentConfig.to_dict()``).
    """

    name: str
    labels: dict[str, str]
    seed: int
    config: dict[str, Any]

    @property
    def combination(self) -> tuple[str, ...]:
        return tuple(self.labels.values())


@dataclass(frozen=True)
class SweepPlan:
    """Every run of a sweep, checked; what ``sweep.json`` records."""

    config_file: str
    tables: dict[str, Any]
    sets: tuple[str, ...]
    axes: tuple[GridAxis, ...]
    seeds: tuple[int, ...]
    runs: tuple[SweepRun, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": PLAN_FORMAT,
            "config_file": self.config_file,
            "config": self.tables,
            "set": list(self.sets),
            "grid": [{"key": a.key, "values": list(a.values), "labels": list(a.labels)} for a in self.axes],
            "seeds": list(self.seeds),
            "runs": [{"name": r.name, "grid": r.labels, "seed": r.seed, "config": r.config} for r in self.runs],
        }

    @classmethod
    def from_json(cls, data: Any, *, path: Path) -> SweepPlan:
        try:
            if data.get("format") != PLAN_FORMAT:
                raise DataError(f"{path}: unknown sweep format {data.get('format')!r}; expected {PLAN_FORMAT}")
            axes = tuple(GridAxis(a["key"], tuple(a["values"]), tuple(a["labels"])) for a in data["grid"])
            # The grid values in the axes' order (sweep.json stores each run's as a sorted object).
            runs = tuple(
                SweepRun(r["name"], {a.key: r["grid"][a.key] for a in axes}, int(r["seed"]), dict(r["config"]))
                for r in data["runs"]
            )
            return cls(
                str(data["config_file"]), dict(data["config"]), tuple(data["set"]), axes, tuple(data["seeds"]), runs
            )
        except (AttributeError, KeyError, TypeError, ValueError) as error:
            raise DataError(f"{path}: not a sweep record ({type(error).__name__}: {error})") from None

    @property
    def keys(self) -> list[str]:
        return [axis.key for axis in self.axes]


def parse_seeds(text: str) -> tuple[int, ...]:
    """``"0-4"``, ``"0,2,7"`` or ``"0-2,10"`` -> the seeds, in order, without repeats.

    Raises:
        UsageError: naming ``--seeds``: not integers, a descending range, a repeat, or too many.
    """
    seeds: list[int] = []
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise UsageError(f"--seeds {text!r}: expected seeds such as 0-4 or 0,2,7 (non-negative integers)")
        first, last = int(match[1]), int(match[2] if match[2] is not None else match[1])
        if last < first:
            raise UsageError(f"--seeds {text!r}: the range {part.strip()} goes down; write it as {last}-{first}")
        if last - first >= MAX_RUNS:
            raise UsageError(f"--seeds {text!r}: more than {MAX_RUNS} seeds")
        for seed in range(first, last + 1):
            if seed in seeds:
                raise UsageError(f"--seeds {text!r}: seed {seed} is given twice")
            seeds.append(seed)
    return tuple(seeds)


def _split_values(text: str) -> list[str]:
    """``a,b,[1, 2],"x,y"`` -> ``["a", "b", "[1, 2]", '"x,y"']``: commas inside brackets, braces or
    quotes do not separate values (a TOML array is one value)."""
    values, depth, quote, start = [], 0, "", 0
    for index, char in enumerate(text):
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:index].strip())
            start = index + 1
    values.append(text[start:].strip())
    return values


def parse_grid(items: Sequence[str]) -> tuple[GridAxis, ...]:
    """``--grid section.key=v1,v2`` options -> axes; values read as TOML, like ``--set``.

    Raises:
        UsageError: naming ``--grid``: no ``=``, not ``section.key``, an empty or repeated value, a
            key given twice, or a seed key (use ``--seeds``).
    """
    from attnlab.experiment import parse_overrides

    axes: list[GridAxis] = []
    for item in items:
        path, sep, raw = item.partition("=")
        key = path.strip()
        section, dot, name = key.partition(".")
        if not sep or not dot or not section or not name:
            raise UsageError(f"--grid {item!r}: expected section.key=value1,value2, e.g. model.attention=soft,hard")
        if key in ("train.seed", "task.seed"):
            raise UsageError(f"--grid {key}: seeds are set by --seeds (a seed sets train.seed and task.seed)")
        if key in (axis.key for axis in axes):
            raise UsageError(f"--grid {key}: the key is given twice; give all its values in one --grid")
        labels = _split_values(raw)
        if any(not label for label in labels):
            raise UsageError(f"--grid {item!r}: an empty value; separate values with single commas")
        if len(set(labels)) != len(labels):
            repeated = next(label for label in labels if labels.count(label) > 1)
            raise UsageError(f"--grid {key}: the value {repeated} is given twice")
        try:
            values = tuple(value for _, _, value in parse_overrides([f"{key}={label}" for label in labels]))
        except ConfigError as error:
            raise UsageError(f"--grid {item!r}: {error}") from None
        axes.append(GridAxis(key, values, tuple(labels)))
    return tuple(axes)


SWEEP_TABLE_KEYS = ("grid", "seeds")


def sweep_table(tables: Mapping[str, Any], path: Path) -> tuple[tuple[GridAxis, ...], str | None]:
    """The grid and seeds a config file's ``[sweep]`` table gives (none and ``None`` without one).

    Args:
        tables: the file's TOML tables.
        path: the file, named in errors.

    Returns:
        ``(axes, seeds)``: one axis per ``[sweep.grid]`` key, in the file's order, its values the
        TOML values themselves (a string is its own label); ``seeds`` as ``--seeds`` writes them.

    Raises:
        ConfigError: naming ``[sweep]`` and the key: an unknown key, a grid entry that is not
            ``section.key = [values]``, an empty list or a repeated value, a seed key in the grid,
            seeds that are not a string such as ``"0-4"`` or a list of integers.
    """
    table = tables.get("sweep")
    if table is None:
        return (), None
    where = f"{path}: [sweep]"
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: expected a table with grid and seeds, got {type(table).__name__}")
    unknown = sorted(set(table) - set(SWEEP_TABLE_KEYS))
    if unknown:
        raise ConfigError(f"{where} {unknown[0]}: unknown key; allowed: {', '.join(SWEEP_TABLE_KEYS)}")
    grid = table.get("grid", {})
    if not isinstance(grid, Mapping):
        raise ConfigError(f'{where} grid: expected a table of "section.key" = [values]')
    axes = tuple(_file_axis(key, values, where) for key, values in grid.items())
    return axes, _file_seeds(table.get("seeds"), where)


def _file_axis(key: str, values: Any, where: str) -> GridAxis:
    """One ``[sweep.grid]`` entry as an axis; its labels are the values as ``--grid`` would write them."""
    section, dot, name = key.partition(".")
    if not dot or not section or not name:
        raise ConfigError(f'{where} grid.{key}: expected a quoted "section.key", e.g. "model.positional"')
    if key in ("train.seed", "task.seed"):
        raise ConfigError(f"{where} grid.{key}: seeds are set by [sweep] seeds (a seed sets train.seed and task.seed)")
    if not isinstance(values, list) or not values:
        raise ConfigError(f'{where} grid."{key}": expected a non-empty list of values, got {values!r}')
    labels = tuple(value if isinstance(value, str) else json.dumps(value) for value in values)
    if len(set(labels)) != len(labels):
        repeated = next(label for label in labels if labels.count(label) > 1)
        raise ConfigError(f'{where} grid."{key}": the value {repeated} is given twice')
    return GridAxis(key, tuple(values), labels, origin="[sweep] grid")


def _file_seeds(seeds: Any, where: str) -> str | None:
    """``[sweep] seeds`` (``"0-4"`` or ``[0, 2, 7]``) as ``--seeds`` text, checked by :func:`parse_seeds`."""
    if seeds is None:
        return None
    if isinstance(seeds, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
        seeds = ",".join(str(s) for s in seeds)
    if not isinstance(seeds, str):
        raise ConfigError(f'{where} seeds: expected a string such as "0-4" or a list of integers, got {seeds!r}')
    try:
        parse_seeds(seeds)
    except UsageError as error:
        raise ConfigError(f"{where} seeds: {str(error).removeprefix('--seeds ')}") from None
    return seeds


def _merge_axes(from_file: Sequence[GridAxis], from_flags: Sequence[GridAxis]) -> tuple[GridAxis, ...]:
    """The file's axes with each ``--grid`` key's values in place of the file's; new keys after them."""
    flags = {axis.key: axis for axis in from_flags}
    merged = [flags.pop(axis.key, axis) for axis in from_file]
    return (*merged, *flags.values())


def _name_part(text: str) -> str:
    """``text`` with every character but letters, digits, ``.`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_") or "_"


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each ``section.key`` by its key alone (``positional``), or in full where two sections share it."""
    names = [key.partition(".")[2] for key in keys]
    return {key: name if names.count(name) == 1 else key for key, name in zip(keys, names)}


def run_names(axes: Sequence[GridAxis], combinations: Sequence[tuple[str, ...]], seeds: Sequence[int]) -> list[str]:
    """The folder name of every (combination, seed), in order: ``positional-learned_attention-hard_seed-3``.

    Labels that read the same once made safe for a file name (``1e-3`` vs ``1e_3``) get a number.
    """
    short = _short_keys([axis.key for axis in axes])
    safe = {}
    for axis in axes:
        parts = [_name_part(label) for label in axis.labels]
        safe[axis.key] = {
            label: part if parts.count(part) == 1 else f"{part}-{index}"
            for index, (label, part) in enumerate(zip(axis.labels, parts))
        }
    names = []
    for combination in combinations:
        pieces = [f"{_name_part(short[a.key])}-{safe[a.key][label]}" for a, label in zip(axes, combination)]
        names.extend("_".join([*pieces, f"seed-{seed}"]) for seed in seeds)
    return names


def _combinations(axes: Sequence[GridAxis]) -> list[tuple[int, ...]]:
    """Index tuples of the grid's product, the first axis varying slowest."""
    combos: list[tuple[int, ...]] = [()]
    for axis in axes:
        combos = [(*combo, index) for combo in combos for index in range(len(axis.values))]
    return combos


def plan_sweep(
    config_file: str | Path, grid: Sequence[str], seeds: str | Sequence[int] | None, sets: Sequence[str] = ()
) -> SweepPlan:
    """Every run of a sweep, each config built and checked as ``attnlab train`` would check it.

    Args:
        config_file: the experiment's TOML file.
        grid: ``section.key=v1,v2,...`` options; each replaces that key of the file's ``[sweep]``
            grid, or adds one (:func:`sweep_table`).
        seeds: ``"0-4"`` (see :func:`parse_seeds`) or the seeds; ``None``: the file's ``[sweep]``
            seeds, else seed 0.
        sets: ``section.key=value`` options fixed for every run, as ``attnlab train --set``.

    Returns:
        The plan; nothing has been written.

    Raises:
        ConfigError, UsageError, DataError: the config, a ``--set`` or a grid value is wrong; a grid
            value is named (``--grid model.positional=rotary: ...``), or the run whose combination
            is refused.
    """
    from attnlab.experiment import apply_overrides, load_experiment, parse_overrides

    load_experiment(config_file, [*SWEEP_DEFAULTS, *sets], flag="--set")  # the file and --set alone
    tables = _read_tables(Path(config_file))
    file_axes, file_seeds = sweep_table(tables, Path(config_file))
    tables = {section: value for section, value in tables.items() if section != "sweep"}
    base = apply_overrides(tables, parse_overrides([*SWEEP_DEFAULTS, *sets], flag="--set"))
    axes = _merge_axes(file_axes, parse_grid(grid))
    if seeds is None:
        seeds = file_seeds if file_seeds is not None else "0"
    seed_list = tuple(seeds) if not isinstance(seeds, str) else parse_seeds(seeds)
    overlap = [axis.key for axis in axes if any(s.partition("=")[0].strip() == axis.key for s in sets)]
    if overlap:
        raise UsageError(f"--grid {overlap[0]}: also fixed by --set; give it in one place")
    combos = _combinations(axes)
    if len(combos) * len(seed_list) > MAX_RUNS:
        raise UsageError(f"--grid/--seeds: {len(combos) * len(seed_list)} runs; a sweep holds at most {MAX_RUNS}")
    tasks: dict[str, Any] = {}
    for axis in axes:  # one value at a time against the base: the error names the value at fault
        for value, label in zip(axis.values, axis.labels):
            _checked(f"{axis.origin} {axis.key}={label}", _build_checked, _assign(base, {axis.key: value}, None), tasks)
    labelled = [tuple(axis.labels[i] for axis, i in zip(axes, combo)) for combo in combos]
    names = iter(run_names(axes, labelled, seed_list))
    runs = []
    for combo, labels in zip(combos, labelled):
        values = {axis.key: axis.values[i] for axis, i in zip(axes, combo)}
        for seed in seed_list:
            name = next(names)
            experiment = _checked(f"run {name}", _build_checked, _assign(base, values, seed), tasks)
            runs.append(SweepRun(name, dict(zip((a.key for a in axes), labels)), seed, experiment.to_dict()))
    return SweepPlan(str(config_file), tables, tuple(sets), axes, seed_list, tuple(runs))


def _read_tables(path: Path) -> dict[str, Any]:
    """The TOML file's tables (already read once by ``load_experiment``, which named any problem)."""
    return tomllib.loads(path.read_text(encoding="utf-8"))


def _assign(base: Mapping[str, Any], values: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """``base`` with the grid values set, and the seed as ``train.seed`` and ``task.seed`` (when the
    task has a seed option)."""
    from attnlab.experiment import apply_overrides
    from attnlab.tasks.registry import TASKS, task_options

    overrides = [(key.partition(".")[0], key.partition(".")[2], value) for key, value in values.items()]
    merged = apply_overrides(base, overrides)
    if seed is not None:
        merged = apply_overrides(merged, [("train", "seed", seed)])
        name = merged.get("task", {}).get("name") if isinstance(merged.get("task"), Mapping) else None
        if name in TASKS and "seed" in task_options(name):
            merged = apply_overrides(merged, [("task", "seed", seed)])
    return merged


def _checked(where: str, build: Callable[..., Any], *args: Any) -> Any:
    """``build(*args)``, with an attnlab error's message prefixed by ``where`` (same class, same exit code)."""
    try:
        return build(*args)
    except AttnlabError as error:
        raise type(error)(f"{where}: {error}") from None


def _build_checked(tables: Mapping[str, Any], tasks: dict[str, Any]) -> Any:
    """The experiment of ``tables``, checked as the trainer checks it before training."""
    from attnlab.experiment import ExperimentConfig

    experiment = ExperimentConfig.from_dict(tables)
    _check_like_train(experiment, tasks)
    return experiment


def _check_like_train(experiment: Any, tasks: dict[str, Any]) -> None:
    """What the trainer checks before it builds a model: the task, the model config the task calls
    for, and the training resources (layers, batch size, memory); and that the validation split,
    and the ``train.final_splits``, which the end-of-training evaluation draws, can be drawn (a
    seed can make a small split of a small language impossible, which training alone would find
    only after its last step)."""
    from attnlab.resources import check_length_bins_fit, check_training_resources
    from attnlab.tasks.base import check_final_splits
    from attnlab.tasks.factory import build_task, model_config_for_task
    from attnlab.training.tensorboard_log import require_tensorboard

    final_splits = experiment.train.final_splits
    key = json.dumps([experiment.task, final_splits], sort_keys=True, default=str)
    if key not in tasks:  # built and drawn once for all the runs that share a task
        task = build_task(experiment.task)[0]
        check_final_splits(task, final_splits)
        for name in ("valid", *final_splits):
            task.split(name)  # scored after the last step: drawn now, where a seed can make it impossible
        tasks[key] = task
    task = tasks[key]
    config = model_config_for_task(experiment, task)
    check_training_resources(
        config,
        batch_size=experiment.train.batch_size,
        examples=task.split("train"),
        max_length=experiment.train.max_length or config.max_len,
    )
    check_length_bins_fit(task, experiment.train.max_length or config.max_len)
    if "tensorboard" in experiment.train.log_to:
        require_tensorboard()  # the package, before any run starts


# ---- running -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepResult:
    """What one call of :func:`run_sweep` did.

    Attributes:
        out: the sweep folder.
        runs: runs in the sweep.
        trained: runs trained (or resumed) by this call.
        skipped: runs finished (or failed) before this call, not run again.
        ok, failed: runs that finished / failed or diverged, over the whole sweep.
        seconds: wall time of this call.
        files: the report's files.
    """

    out: Path
    runs: int
    trained: int
    skipped: int
    ok: int
    failed: int
    seconds: float
    files: list[Path] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "runs": self.runs,
            "trained": self.trained,
            "skipped": self.skipped,
            "ok": self.ok,
            "failed": self.failed,
            "seconds": self.seconds,
            "files": [str(path) for path in self.files],
        }


@dataclass(frozen=True)
class _Job:
    """A run for a worker: its folder, its config, whether to resume it."""

    name: str
    path: str
    config: dict[str, Any]
    resume: bool


def check_sweep_folder(out: Path, plan: SweepPlan) -> bool:
    """Check that ``out`` can hold ``plan``: a new or empty folder, or this sweep's own (a resume).

    Returns:
        True when ``out`` already holds this sweep (a resume).

    Raises:
        UsageError: ``out`` holds something else, or a sweep with another grid, seeds or config.
    """
    from attnlab.run.lock import LOCK_NAME
    from attnlab.run.output_paths import check_output_path

    check_output_path(out, kind="folder", flag="--out")
    record = out / PLAN_FILE
    if not record.exists():
        if out.is_dir() and any(p.name != LOCK_NAME for p in out.iterdir()):
            raise UsageError(f"--out {out}: the folder is not empty and holds no {PLAN_FILE}; choose another --out")
        return False
    held = read_plan(out)
    difference = _plan_difference(held, plan)
    if difference:
        raise UsageError(
            f"--out {out} holds a sweep with {difference}; resume it with the same config, --grid, --seeds "
            f"and --set, or choose another --out"
        )
    return True


def _plan_difference(held: SweepPlan, plan: SweepPlan) -> str:
    """What differs between a recorded sweep and a new plan, in words; empty when they agree."""
    if held.keys != plan.keys:
        return f"another grid (keys {', '.join(held.keys) or 'none'}, not {', '.join(plan.keys) or 'none'})"
    for old, new in zip(held.axes, plan.axes):
        if old.labels != new.labels:
            return f"another grid ({old.key}={','.join(old.labels)}, not {','.join(new.labels)})"
    if held.seeds != plan.seeds:
        return f"other seeds ({_seed_text(held.seeds)}, not {_seed_text(plan.seeds)})"
    old_runs = {run.name: run.config for run in held.runs}
    for run in plan.runs:
        if json.dumps(old_runs.get(run.name), sort_keys=True) != json.dumps(run.config, sort_keys=True):
            key = _first_difference(old_runs.get(run.name) or {}, run.config)
            return f"another config (run {run.name}: {key} differs; check the config file and --set)"
    return ""


def _first_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"{section}.{key} ({a.get(key)!r} recorded, {b.get(key)!r} now)"
    return "the config"


def _seed_text(seeds: Sequence[int]) -> str:
    return ",".join(str(seed) for seed in seeds)


def read_plan(out: Path) -> SweepPlan:
    """The sweep recorded in ``out/sweep.json``.

    Raises:
        UsageError: no sweep there. DataError: the record is damaged.
    """
    from attnlab.run.storage import parse_json, read_bytes

    path = Path(out) / PLAN_FILE
    if not path.exists():
        raise UsageError(f"{out}: not a sweep folder (no {PLAN_FILE})")
    return SweepPlan.from_json(
        parse_json(read_bytes(path, what="sweep record"), path=path, what="sweep record"), path=path
    )


def run_sweep(
    plan: SweepPlan,
    out: str | Path,
    *,
    jobs: int = 1,
    progress: bool = False,
    retry_failed: bool = False,
) -> SweepResult:
    """Train every run of ``plan`` not finished yet in ``out``, ``jobs`` at a time, then write the report.

    Args:
        plan: from :func:`plan_sweep`.
        out: the sweep folder (new, empty, or holding this sweep: then it resumes).
        jobs: trainings at once, each in a worker process.
        progress: a bar over the runs on stderr.
        retry_failed: train the runs recorded as failed or diverged again (from scratch).

    Returns:
        What was done; the report's files.

    Raises:
        UsageError: ``out`` holds something else, or another process is running this sweep.
    """
    from tqdm import tqdm

    from attnlab.experiment import ExperimentConfig
    from attnlab.kernels import native
    from attnlab.run.lock import RunLock
    from attnlab.run.storage import atomic_write_json, ensure_folder

    if jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {jobs}")
    out = Path(out)
    started = time.perf_counter()
    resuming = check_sweep_folder(out, plan)
    ensure_folder(out)
    with RunLock(out):
        if not resuming:
            atomic_write_json(out / PLAN_FILE, plan.to_json())
        todo = _jobs_to_run(plan, out, retry_failed=retry_failed)
        skipped = len(plan.runs) - len(todo)
        native.prepare(*(ExperimentConfig.from_dict(job.config).train.device for job in todo))  # before the bar
        bar = tqdm(total=len(plan.runs), initial=skipped, desc="sweep", unit="run", disable=not progress, leave=False)
        failed = 0

        def finished(job: _Job, outcome: dict[str, Any]) -> None:
            nonlocal failed
            atomic_write_json(out / OUTCOMES_FOLDER / f"{job.name}.json", outcome)
            for message in outcome.get("warnings", []):
                warnings.warn(f"run {job.name}: {message}", AttnlabWarning, stacklevel=2)
            failed += outcome["status"] != OK
            bar.update(1)
            bar.set_postfix(failed=failed)

        try:
            _run_jobs(todo, jobs, finished)
        finally:
            bar.close()
        files = write_report(out)
    rows = collect_rows(out)[1]
    return SweepResult(
        out=out,
        runs=len(plan.runs),
        trained=len(todo),
        skipped=skipped,
        ok=sum(row["status"] == OK for row in rows),
        failed=sum(row["status"] in (FAILED, DIVERGED) for row in rows),
        seconds=time.perf_counter() - started,
        files=files,
    )


def _jobs_to_run(plan: SweepPlan, out: Path, *, retry_failed: bool) -> list[_Job]:
    """The runs this call trains: never run, interrupted (resumed from their last checkpoint, or
    started over without one), and with ``retry_failed`` the failed ones (started over)."""
    from attnlab.errors import CheckpointError
    from attnlab.run.directory import RunDir

    todo = []
    for run in plan.runs:
        path = out / RUNS_FOLDER / run.name
        outcome = _read_outcome(out, run.name)
        if outcome is not None and (outcome.get("status") == OK or not retry_failed):
            continue
        resume = False
        if outcome is None and path.is_dir():
            try:
                resume = (path / RunDir.CONFIG).exists() and RunDir(path).latest_checkpoint() is not None
            except CheckpointError:
                resume = False
        if not resume and path.exists():
            shutil.rmtree(path)
        (out / OUTCOMES_FOLDER / f"{run.name}.json").unlink(missing_ok=True)
        todo.append(_Job(run.name, str(path), run.config, resume))
    return todo


def _read_outcome(out: Path, name: str) -> dict[str, Any] | None:
    path = out / OUTCOMES_FOLDER / f"{name}.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # a damaged outcome: the run counts as interrupted
    return record if isinstance(record, dict) and "status" in record else None


def _run_jobs(todo: Sequence[_Job], jobs: int, finished: Callable[[_Job, dict[str, Any]], None]) -> None:
    """Train ``todo``, calling ``finished(job, outcome)`` for each: with ``jobs == 1`` one after
    another in this process, otherwise on ``jobs`` worker processes.

    At most ``jobs`` runs are handed out at once, so when a worker process dies (killed, out of
    memory) only the runs in flight are affected: they are handed out again, and recorded as failed
    once their worker has died :data:`MAX_WORKER_DEATHS` times.
    """
    if jobs == 1:  # one after another, in this process: no worker to start
        for job in todo:
            finished(job, _train_one(job))
        return
    pending = deque(todo)
    deaths: dict[str, int] = {}
    context = multiprocessing.get_context("spawn")  # the parent holds torch's threads: never fork it
    while pending:
        workers = min(jobs, len(pending))
        with ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_worker_start) as pool:
            in_flight: dict[Future, _Job] = {}
            broken = False
            while (pending or in_flight) and not broken:
                while pending and len(in_flight) < workers:
                    job = pending.popleft()
                    in_flight[pool.submit(_train_one, job)] = job
                done, _ = wait(in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    job = in_flight.pop(future)
                    try:
                        finished(job, future.result())
                    except BrokenProcessPool:
                        broken = True
                        _worker_died(job, deaths, pending, finished)
            if broken:
                for future, job in in_flight.items():
                    future.cancel()
                    _worker_died(job, deaths, pending, finished)


def _worker_died(
    job: _Job, deaths: dict[str, int], pending: deque[_Job], finished: Callable[[_Job, dict[str, Any]], None]
) -> None:
    deaths[job.name] = deaths.get(job.name, 0) + 1
    if deaths[job.name] >= MAX_WORKER_DEATHS:
        error = f"the training process died {deaths[job.name]} times (killed, or out of memory?)"
        finished(job, {"status": FAILED, "error": error, "steps": None, "wall_s": None, "resumed": job.resume})
        return
    path = Path(job.path)
    pending.appendleft(_Job(job.name, job.path, job.config, _resumable(path)))


def _resumable(path: Path) -> bool:
    from attnlab.errors import CheckpointError
    from attnlab.run.directory import RunDir

    try:
        if path.is_dir() and RunDir(path).latest_checkpoint() is not None:
            return True
    except CheckpointError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    return False


def _worker_start() -> None:
    """In each worker: keep the memory a step frees, as ``attnlab train`` does; import the trainer once."""
    from attnlab.runtime import keep_freed_memory
    from attnlab.training import trainer  # noqa: F401 - imported once per worker, not per run

    keep_freed_memory()


def _train_one(job: _Job) -> dict[str, Any]:
    """Train (or resume) one run in a worker; any error becomes the outcome's one-line ``error``."""
    from attnlab.experiment import ExperimentConfig
    from attnlab.training.trainer import TrainingDiverged, train

    started = time.perf_counter()
    status, error, steps = OK, None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AttnlabWarning)
        try:
            result = train(ExperimentConfig.from_dict(job.config), job.path, resume=job.resume, progress=False)
            steps = result.step
        except TrainingDiverged as diverged:
            status, error = DIVERGED, _one_line(str(diverged))
        except AttnlabError as failure:
            status, error = FAILED, _one_line(str(failure))
        except Exception as failure:  # noqa: BLE001 - recorded, and the sweep goes on
            status, error = FAILED, _one_line(f"internal error: {type(failure).__name__}: {failure}")
    return {
        "status": status,
        "error": error,
        "steps": steps,
        "wall_s": time.perf_counter() - started,
        "resumed": job.resume,
        "warnings": [_one_line(str(w.message)) for w in caught if issubclass(w.category, AttnlabWarning)],
    }


def _one_line(message: str) -> str:
    return " ".join(message.split())


# ---- the report ----------------------------------------------------------------------------------


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
    """One run as the report sees it: its row of results.csv, and accuracy per length per split."""

    run: SweepRun
    row: dict[str, Any]
    by_length: dict[str, dict[int, float]]


def _run_report(out: Path, plan: SweepPlan, run: SweepRun) -> _RunReport:
    from attnlab.run.directory import RunDir

    outcome = _read_outcome(out, run.name) or {}
    status = outcome.get("status", PENDING)
    row: dict[str, Any] = {"run": run.name, **run.labels, "seed": run.seed, "status": status}
    row["error"] = outcome.get("error") or ""
    by_length: dict[str, dict[int, float]] = {}
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
    else:
        row["steps"] = outcome.get("steps")
        row["wall_s"] = outcome.get("wall_s")
    return _RunReport(run, row, by_length)


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
    """Splits in reading order: train, valid, test, length_generalisation, then the others by name."""
    first = ("train", "valid", "test", "length_generalisation")
    return sorted(set(splits), key=lambda s: (first.index(s) if s in first else len(first), _natural(s)))


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
    ``accuracy_by_length``), for plots of one's own."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", *plan.keys, "seed", "split", "length", "accuracy"])
    for report in reports:
        for split in _split_order(report.by_length):
            for length, accuracy in sorted(report.by_length[split].items()):
                labels = [report.run.labels[key] for key in plan.keys]
                writer.writerow([report.run.name, *labels, report.run.seed, split, length, repr(accuracy)])
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


def summary_markdown(plan: SweepPlan, rows: Sequence[Mapping[str, Any]]) -> str:
    """``summary.md``: per combination and split, accuracy mean ± std and min–max over seeds."""
    keys = plan.keys
    by_combination: dict[tuple[str, ...], list[Mapping[str, Any]]] = {}
    for run, row in zip(plan.runs, rows):
        by_combination.setdefault(run.combination, []).append(row)
    splits = _split_order({c.partition(".")[0] for r in rows for c in r if c.endswith(".accuracy")})
    baseline = any(f"{s}.baseline_accuracy" in r for r in rows for s in splits)
    trained = any(isinstance(r.get(f"{s}.trained"), bool) for r in rows for s in splits)
    header = [*keys, "split", "accuracy (mean ± std)", "min–max", "n", "failed"]
    header += ["baseline"] * baseline + ["trained"] * trained
    grid = "; ".join(a.key + " = " + ", ".join(a.labels) for a in plan.axes)
    lines = [
        f"# Sweep of {plan.config_file}",
        "",
        f"Grid: {grid or 'none'}. "
        f"Seeds: {_seed_text(plan.seeds)}." + (f" Fixed: {', '.join(plan.sets)}." if plan.sets else ""),
        "",
        "Accuracy of the end-of-training evaluation, per combination and split, over the seeds that "
        "finished: mean ± sample standard deviation (n − 1), min–max; n runs finished, failed runs "
        "(errors below and in results.csv)"
        + ("; baseline: the evaluation's baseline accuracy, mean" if baseline else "")
        + ("; trained: runs that fit their training split" if trained else "")
        + ".",
        "",
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
            cells = [*combination, split, f"{_fmt(stats['mean'])} ± {_fmt(stats['std'])}"]
            cells += [f"{_fmt(stats['min'])}–{_fmt(stats['max'])}", str(stats["n"]), str(failed)]
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
    problems = [r for r in rows if r["status"] in (FAILED, DIVERGED)]
    pending = [r for r in rows if r["status"] == PENDING]
    if problems:
        lines += ["", "## Failed runs", ""]
        lines += [f"- `{r['run']}` ({r['status']}): {r['error']}" for r in problems]
    if pending:
        lines += ["", f"{len(pending)} runs have not finished: {', '.join(r['run'] for r in pending)}."]
    return "\n".join(lines) + "\n"


def _plot_by_length(plan: SweepPlan, reports: Sequence[_RunReport], folder: Path) -> list[Path]:
    """One PNG per split: accuracy against length, one line per combination (mean over seeds),
    a band from the lowest to the highest seed."""
    from matplotlib.ticker import MaxNLocator

    from attnlab.figures import plt, save_figure

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
            label = ", ".join(f"{k.partition('.')[2]}={v}" for k, v in zip(plan.keys, combination)) or "all runs"
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
        written.append(save_figure(fig, folder / f"accuracy_by_length-{_name_part(split)}.png", dpi=100))
    return written


def write_report(out: str | Path) -> list[Path]:
    """Rebuild ``results.csv``, ``accuracy_by_length.csv``, ``summary.md`` and ``plots/`` from the sweep's runs.

    Returns:
        The files written.

    Raises:
        UsageError: ``out`` is not a sweep folder. CheckpointError: a run's metrics are damaged.
    """
    from attnlab.run.storage import atomic_write_text, ensure_folder

    out = Path(out)
    plan = read_plan(out)
    reports = _collect(out, plan)
    rows = [report.row for report in reports]
    atomic_write_text(out / RESULTS_FILE, results_csv(plan, rows))
    atomic_write_text(out / BY_LENGTH_FILE, by_length_csv(plan, reports))
    atomic_write_text(out / SUMMARY_FILE, summary_markdown(plan, rows))
    folder = ensure_folder(out / PLOTS_FOLDER)
    for old in folder.glob("accuracy_by_length-*.png"):
        old.unlink()
    files = [out / RESULTS_FILE, out / BY_LENGTH_FILE, out / SUMMARY_FILE]
    return [*files, *_plot_by_length(plan, reports, folder)]
