"""The Speed target of ``attnlab sweep``: a 20-run sweep against the same 20 runs as single commands.

    python benchmarks/sweep_speed.py [--steps 200] [--rounds 1] [--out DIR]

The 20 runs are ``configs/parity.toml`` at ``--steps`` steps over model.attention = soft, hard x
model.positional = sinusoidal, learned x seeds 0-4, on one thread each (the sweep's default). Each
round times, in a rotating order: the 20 runs as 20 ``attnlab train`` commands one after another
(the hand-written loop a sweep replaces; each command pays its own start-up), ``attnlab sweep
--jobs 1`` and ``attnlab sweep --jobs 2``. Targets: ``--jobs 1`` at most 1.1x the sum of the
single runs, ``--jobs 2`` faster than ``--jobs 1``. Prints one JSON object. Not a test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "parity.toml"
GRID = ["model.attention=soft,hard", "model.positional=sinusoidal,learned"]
SEEDS = range(5)


def _sets(steps: int) -> list[str]:
    return [f"train.steps={steps}", "train.eval_every=0", "train.checkpoint_every=0", "train.threads=1"]


CPU: dict[str, float] = {}
"""CPU seconds (user + system) of the commands each system ran, summed over rounds."""


def _attnlab(*args: str, system: str = "") -> float:
    started, before = time.perf_counter(), _children_cpu()
    subprocess.run([sys.executable, "-m", "attnlab", *args], check=True, capture_output=True)
    CPU[system] = CPU.get(system, 0.0) + _children_cpu() - before
    return time.perf_counter() - started


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _singles(folder: Path, steps: int) -> float:
    total = 0.0
    for attention in ("soft", "hard"):
        for positional in ("sinusoidal", "learned"):
            for seed in SEEDS:
                sets = [*_sets(steps), f'model.attention="{attention}"', f'model.positional="{positional}"']
                sets += [f"train.seed={seed}", f"task.seed={seed}"]
                out = folder / f"single-{attention}-{positional}-{seed}"
                total += _attnlab(
                    "train",
                    str(CONFIG),
                    *[x for s in sets for x in ("--set", s)],
                    "--out",
                    str(out),
                    "--no-progress",
                    system="singles",
                )
    return total


def _sweep(folder: Path, steps: int, jobs: int) -> tuple[float, float]:
    out = folder / f"sweep-jobs{jobs}"
    args = ["sweep", str(CONFIG), *[x for g in GRID for x in ("--grid", g)], "--seeds", "0-4", "--out", str(out)]
    args += [x for s in _sets(steps) for x in ("--set", s)] + ["--jobs", str(jobs), "--no-progress"]
    seconds = _attnlab(*args, system=f"jobs{jobs}")
    trained = sum(json.loads(p.read_text())["wall_s"] for p in (out / "outcomes").glob("*.json"))
    return seconds, trained


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--offset", type=int, default=0, help="start the rotation of the order here")
    parser.add_argument("--systems", default="singles,jobs1,jobs2", help="which to time, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    args = parser.parse_args()
    times: dict[str, list[float]] = {"singles_sum": [], "jobs1": [], "jobs2": [], "jobs1_trained": []}
    for round_ in range(args.rounds):
        folder = Path(tempfile.mkdtemp(prefix="sweep-speed-", dir=args.out))
        order = args.systems.split(",")
        turn = (round_ + args.offset) % len(order)
        order = order[turn:] + order[:turn]
        for system in order:
            if system == "singles":
                times["singles_sum"].append(_singles(folder, args.steps))
            else:
                seconds, trained = _sweep(folder, args.steps, int(system[-1]))
                times[system].append(seconds)
                if system == "jobs1":
                    times["jobs1_trained"].append(trained)
        if args.out is None:
            shutil.rmtree(folder, ignore_errors=True)
    medians = {name: statistics.median(values) if values else math.nan for name, values in times.items()}
    print(
        json.dumps(
            {
                "runs": 20,
                "steps": args.steps,
                "rounds": args.rounds,
                "cpus": os.cpu_count(),
                "seconds": times,
                "cpu_seconds": CPU,
                "jobs1_over_singles_sum": medians["jobs1"] / medians["singles_sum"],
                "jobs2_over_jobs1": medians["jobs2"] / medians["jobs1"],
                "jobs1_over_its_runs_training": medians["jobs1"] / medians["jobs1_trained"],
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
