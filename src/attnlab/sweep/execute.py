"""A sweep carried out: every run not finished yet trained, ``jobs`` at a time, each outcome
recorded, then the report written (see :mod:`attnlab.sweep`)."""

from __future__ import annotations

import json
import multiprocessing
import shutil
import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from attnlab.errors import AttnlabError, AttnlabWarning, CheckpointError, UsageError
from attnlab.experiment import ExperimentConfig
from attnlab.kernels import native
from attnlab.run.directory import RunDir
from attnlab.run.lock import LOCK_NAME, RunLock
from attnlab.run.output_paths import check_output_path
from attnlab.run.storage import atomic_write_json, ensure_folder
from attnlab.runtime import keep_freed_memory
from attnlab.sweep.folder import DIVERGED, FAILED, OK, OUTCOMES_FOLDER, PLAN_FILE, RUNS_FOLDER, read_outcome, read_plan
from attnlab.sweep.plan import SweepPlan, seed_text
from attnlab.sweep.report import collect_rows, write_report
from attnlab.training.trainer import TrainingDiverged, train

__all__ = ["SweepResult", "check_sweep_folder", "run_sweep"]

MAX_WORKER_DEATHS = 2
"""A run whose worker process died this many times (killed, out of memory) is recorded as failed."""


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
        return f"other seeds ({seed_text(held.seeds)}, not {seed_text(plan.seeds)})"
    old_runs = {(run.combination, run.seed): run.config for run in held.runs}  # by values, not by name
    for run in plan.runs:
        old = old_runs.get((run.combination, run.seed))
        if json.dumps(old, sort_keys=True) != json.dumps(run.config, sort_keys=True):
            key = _first_difference(old or {}, run.config)
            return f"another config (run {run.name}: {key} differs; check the config file and --set)"
    return ""


def _first_difference(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    for section in sorted(set(old) | set(new)):
        a, b = old.get(section, {}), new.get(section, {})
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"{section}.{key} ({a.get(key)!r} recorded, {b.get(key)!r} now)"
    return "the config"


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
    if jobs < 1:
        raise UsageError(f"--jobs: must be >= 1, got {jobs}")
    out = Path(out)
    started = time.perf_counter()
    resuming = check_sweep_folder(out, plan)
    ensure_folder(out)
    with RunLock(out):
        if resuming:  # the same runs, under the names recorded (a sweep from before full-key names keeps its own)
            plan = read_plan(out)
        else:
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
    todo = []
    for run in plan.runs:
        path = out / RUNS_FOLDER / run.name
        outcome = read_outcome(out, run.name)
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
    try:
        if path.is_dir() and RunDir(path).latest_checkpoint() is not None:
            return True
    except CheckpointError:
        pass
    shutil.rmtree(path, ignore_errors=True)
    return False


def _worker_start() -> None:
    """In each worker: keep the memory a step frees, as ``attnlab train`` does."""
    keep_freed_memory()


def _train_one(job: _Job) -> dict[str, Any]:
    """Train (or resume) one run in a worker; any error becomes the outcome's one-line ``error``."""
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
