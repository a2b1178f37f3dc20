"""A sweep's plan: the grid, the seeds and every run's config, built and checked before anything
is written (see :mod:`attnlab.sweep`)."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError, ConfigError, DataError, UsageError
from attnlab.experiment import ExperimentConfig, apply_overrides, load_experiment, parse_overrides
from attnlab.limits import MAX_SEED
from attnlab.reading import read_capped
from attnlab.tasks.registry import TASKS, build_task, task_options
from attnlab.training.checks import check_log_targets, check_resources, check_splits

__all__ = [
    "GridAxis",
    "SweepRun",
    "SweepPlan",
    "parse_grid",
    "parse_seeds",
    "plan_sweep",
    "run_names",
    "sweep_table",
]

PLAN_FORMAT = 1

SWEEP_DEFAULTS = ("train.threads=1", 'train.final_splits=["test", "length_generalisation"]')
"""Set on every run before ``--set``: one thread per training, so that ``jobs`` runs share the
cores without oversubscription and a run's numbers do not depend on ``jobs``; and the test and
length-generalisation splits scored after the last step, beside valid and the length bins, so that
the report has every split."""

MAX_RUNS = 10_000
"""The most runs one sweep may hold (a grid typo such as ``--seeds 0-100000`` is refused)."""


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
        UsageError: naming ``--seeds``: not integers, a seed past :data:`~attnlab.limits.MAX_SEED`, a
            descending range, a repeat, or too many.
    """
    seeds: list[int] = []
    for part in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise UsageError(f"--seeds {text!r}: expected seeds such as 0-4 or 0,2,7 (non-negative integers)")
        bounds = [match[1], match[2] if match[2] is not None else match[1]]
        if any(len(digits) > len(str(MAX_SEED)) or int(digits) > MAX_SEED for digits in bounds):
            raise UsageError(f"--seeds: a seed lies in [0, {MAX_SEED:,}] (attnlab.limits.MAX_SEED)")
        first, last = int(bounds[0]), int(bounds[1])
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


def run_names(axes: Sequence[GridAxis], combinations: Sequence[tuple[str, ...]], seeds: Sequence[int]) -> list[str]:
    """The folder name of every (combination, seed), in order, each grid key in full:
    ``model.positional-learned_model.attention-hard_seed-3`` (``task.name-dyck1``, never ``name-dyck1``).

    Labels that read the same once made safe for a file name (``1e-3`` vs ``1e_3``) get a number.
    Sweeps recorded before the names carried full keys keep their recorded names (the report and a
    resume read them from ``sweep.json``).

    Args:
        axes: the grid.
        combinations: one label per axis, per combination.
        seeds: the seeds, each combination's runs in this order.

    Returns:
        One name per (combination, seed), the seeds varying fastest.
    """
    safe = {}
    for axis in axes:
        parts = [name_part(label) for label in axis.labels]
        safe[axis.key] = {
            label: part if parts.count(part) == 1 else f"{part}-{index}"
            for index, (label, part) in enumerate(zip(axis.labels, parts))
        }
    names = []
    for combination in combinations:
        pieces = [f"{name_part(a.key)}-{safe[a.key][label]}" for a, label in zip(axes, combination)]
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
    return tomllib.loads(read_capped(path).decode("utf-8"))


def _assign(base: Mapping[str, Any], values: Mapping[str, Any], seed: int | None) -> dict[str, Any]:
    """``base`` with the grid values set, and the seed as ``train.seed`` and ``task.seed`` (when the
    task has a seed option)."""
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


def _build_checked(tables: Mapping[str, Any], tasks: dict[str, Any]) -> ExperimentConfig:
    """The experiment of ``tables``, checked by the trainer's own checks before training
    (:func:`~attnlab.training.checks.check_log_targets`, :func:`~attnlab.training.checks.check_splits`,
    :func:`~attnlab.training.checks.check_resources`); ``tasks`` keeps each task built and its
    splits drawn once for all the runs that share it."""
    experiment = ExperimentConfig.from_dict(tables)
    check_log_targets(experiment.train)  # the package, before any run starts
    final_splits = experiment.train.final_splits
    key = json.dumps([experiment.task, final_splits], sort_keys=True, default=str)
    if key not in tasks:
        task = build_task(experiment.task)[0]
        check_splits(task, final_splits)
        tasks[key] = task
    task = tasks[key]
    check_resources(experiment, task, task.split("train"))
    return experiment


def name_part(text: str) -> str:
    """``text`` with every character but letters, digits, ``.`` and ``-`` replaced by ``_``."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_") or "_"


def seed_text(seeds: Sequence[int]) -> str:
    """Seeds as ``--seeds`` writes them: ``0,1,2``."""
    return ",".join(str(seed) for seed in seeds)
