"""``attnlab bench sweep``: a 20-run sweep against the same 20 runs as single ``attnlab train`` commands.

The runs are the parity classifier of ``configs/parity.toml`` (written here, so that the benchmark
does not need the repository) at 200 steps over model.attention = soft, hard x model.positional =
sinusoidal, learned x seeds 0-4, one thread each (the sweep's default), without evaluations or
checkpoints along the way. Each round times, in a rotating order:

* ``singles``: the 20 runs as 20 ``attnlab train`` commands one after another, the hand-written
  loop a sweep replaces (each command pays Python's and PyTorch's start-up);
* ``jobs1``: ``attnlab sweep --jobs 1`` (one process trains every run);
* ``jobs2``: ``attnlab sweep --jobs 2`` (two worker processes).

Targets (issue: length generalisation as a science): ``jobs1`` at most 1.1x the sum of the single
runs, and ``jobs2`` faster than ``jobs1``. Each system runs as a subprocess, timed by the wall clock.
``--quick``: 2 runs of 10 steps, a smoke test of every path.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from attnlab.bench.harness import BenchResult

__all__ = ["run_sweep_bench", "PARITY"]

PARITY = """
[task]
name = "parity"
max_train_length = 8
train_size = 4000
valid_size = 400
test_size = 400
length_generalisation_size = 400
seed = 0

[model]
kind = "encoder_classifier"
layers = 2
d_model = 64
heads = 4
d_ff = 128
dropout = 0.0
attention = "soft"
positional = "sinusoidal"

[train]
steps = 2000
batch_size = 64
lr = 2e-3
warmup = 100
log_every = 50
seed = 0
"""
"""``configs/parity.toml``'s experiment."""


def _sizes(quick: bool) -> tuple[dict[str, list[str]], list[int], int]:
    """The grid (key -> values), the seeds and the steps."""
    if quick:
        return {"model.attention": ["soft", "hard"]}, [0], 10
    return {"model.attention": ["soft", "hard"], "model.positional": ["sinusoidal", "learned"]}, list(range(5)), 200


def _sets(steps: int) -> list[str]:
    return [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.threads=1"]


def _attnlab(*args: str) -> float:
    """Wall seconds of one ``attnlab`` command in a fresh process."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "attnlab", *args], check=True, capture_output=True)
    return time.perf_counter() - started


def _options(flag: str, values: list[str]) -> list[str]:
    return [part for value in values for part in (flag, value)]


def _singles(config: Path, folder: Path, grid: dict[str, list[str]], seeds: list[int], steps: int) -> float:
    combinations: list[dict[str, str]] = [{}]
    for key, values in grid.items():
        combinations = [{**combo, key: value} for combo in combinations for value in values]
    total = 0.0
    for index, combo in enumerate(combinations):
        for seed in seeds:
            sets = [*_sets(steps), *(f'{k}="{v}"' for k, v in combo.items()), f"train.seed={seed}", f"task.seed={seed}"]
            out = folder / f"single-{index}-{seed}"
            total += _attnlab("train", str(config), *_options("--set", sets), "--out", str(out), "--no-progress")
    return total


def _sweep(config: Path, folder: Path, grid: dict[str, list[str]], seeds: list[int], steps: int, jobs: int) -> float:
    args = ["sweep", str(config), *_options("--grid", [f"{k}={','.join(v)}" for k, v in grid.items()])]
    args += ["--seeds", ",".join(map(str, seeds)), "--out", str(folder / f"sweep-jobs{jobs}")]
    args += [*_options("--set", _sets(steps)), "--jobs", str(jobs), "--no-progress"]
    return _attnlab(*args)


def run_sweep_bench(quick: bool = False, rounds: int = 1) -> BenchResult:
    """Time the three systems (see the module docstring) in ``rounds`` rotating rounds; medians."""
    grid, seeds, steps = _sizes(quick)
    runs = len(seeds) * math.prod(len(v) for v in grid.values())
    times: dict[str, list[float]] = {"singles": [], "jobs1": [], "jobs2": []}
    order = list(times)
    with tempfile.TemporaryDirectory(prefix="attnlab-bench-sweep-") as scratch:
        config = Path(scratch) / "parity.toml"
        config.write_text(PARITY, encoding="utf-8")
        for round_ in range(rounds):
            folder = Path(scratch) / f"round-{round_}"
            turn = order[round_ % 3 :] + order[: round_ % 3]
            for system in turn:
                if system == "singles":
                    times[system].append(_singles(config, folder, grid, seeds, steps))
                else:
                    times[system].append(_sweep(config, folder, grid, seeds, steps, jobs=int(system[-1])))
            shutil.rmtree(folder, ignore_errors=True)
    result = BenchResult("sweep")
    medians = {system: statistics.median(values) for system, values in times.items()}
    for system, seconds in medians.items():
        result.add(system, f"seconds for {runs} runs of {steps} steps", seconds, "s")
    result.ratios["jobs1_over_singles"] = medians["jobs1"] / medians["singles"]
    result.ratios["jobs2_over_jobs1"] = medians["jobs2"] / medians["jobs1"]
    result.targets = {"jobs1_over_singles": ("<=", 1.1), "jobs2_over_jobs1": ("<=", 1.0)}
    result.notes.append(
        f"{runs} parity runs x {steps} steps, one thread each; singles = {runs} `attnlab train` commands "
        f"one after another (each pays its start-up); {rounds} round(s), medians."
    )
    return result
