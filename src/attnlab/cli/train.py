"""``attnlab train``: train a model from a TOML config, resume a run, or spread it over processes."""

from __future__ import annotations

import os
import time
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.choices import Precision, value_of
from attnlab.cli.options import device_option, json_option, print_json, progress_option
from attnlab.errors import UsageError
from attnlab.limits import MAX_PROCESSES
from attnlab.run.output_paths import check_output_path


@app.command()
def train(
    config: Path = typer.Argument(None, help="The experiment's TOML file (see configs/)."),
    overrides: list[str] = typer.Option([], "--set", help="Override a key: section.key=value (repeatable)."),
    out: Path = typer.Option(None, "--out", help="The run directory to create (default runs/<task>-<time>)."),
    resume: Path = typer.Option(
        None,
        "--resume",
        help="Continue the run in this directory from its last checkpoint, with the config it was trained with "
        "(no CONFIG); --set may change \\[train] keys (e.g. train.steps), not \\[model] or \\[task] ones.",
    ),
    nproc: int = typer.Option(
        1, "--nproc", min=1, max=MAX_PROCESSES, help="Train on N processes with DistributedDataParallel (torchrun)."
    ),
    device: str = device_option(
        None, "auto (the GPU when there is one), cpu, cuda or cuda:N; same as --set train.device=... (auto resolved)."
    ),
    precision: Precision = typer.Option(None, "--precision", help="Same as --set train.precision=..."),
    attention: str = typer.Option(
        None, "--attention", help="auto, sdpa, explicit or native: same as --set runtime.attention=..."
    ),
    kernels: str = typer.Option(
        None,
        "--kernels",
        help="fixed (the default: never timed, bit-reproducible) or measured (the fastest here): "
        "same as --set runtime.kernels=...",
    ),
    like: Path = typer.Option(
        None, "--like", help="Run with the kernel choices this other run recorded (its kernels.json), to repeat it."
    ),
    progress: bool = progress_option(),
    as_json: bool = json_option(
        "Print one JSON object when training ends: run, steps, final loss, validation metrics, seconds "
        "(the log goes to stderr)."
    ),
) -> None:
    """Train a model on a task; writes a run directory (config, weights, checkpoints, metrics, plots)."""
    from attnlab.experiment import load_experiment
    from attnlab.run.directory import RunDir
    from attnlab.run.loaded import run_experiment

    overrides = list(overrides)
    if device:
        overrides.append(f"train.device={device!r}".replace("'", '"'))
    if precision:
        overrides.append(f'train.precision="{value_of(precision)}"')
    runtime = {"attention": attention, "kernels": kernels}
    overrides += [f'runtime.{key}="{value}"' for key, value in runtime.items() if value]
    if resume is not None:
        if config is not None:
            raise UsageError(
                f"CONFIG {config}: not with --resume, which continues {resume} with the config it was trained "
                "with; give one or the other (--set changes [train] keys of a resume)"
            )
        saved = run_experiment(RunDir.open(resume))
        experiment = saved.with_overrides(overrides, flag="--set")
        changed = saved.changed_keys(experiment)
        if changed:  # before any weight is read: the saved weights and data were made with the old values
            raise UsageError(
                f"--set {', '.join(changed)}: a resume cannot change [model] or [task] keys (the run's weights and "
                "data were made with them); train a new run with --out instead"
            )
        run_path = resume
    elif config is None:
        raise UsageError("give a CONFIG.toml to train, or --resume RUN to continue a run")
    else:
        experiment = load_experiment(config, overrides, flag="--set")
        run_path = out or Path("runs") / f"{experiment.task_name}-{time.strftime('%Y%m%d-%H%M%S')}"
        check_output_path(run_path, kind="run", flag="--out")
    if nproc > 1:
        from attnlab.devices import check_processes

        try:
            check_processes(experiment.train.device, nproc)
        except ValueError as exc:
            raise UsageError(f"--nproc {nproc}: {exc}") from None
        _spawn(nproc, config, overrides, run_path, resume is not None, progress, as_json, like)
        return
    from attnlab.runtime import keep_freed_memory
    from attnlab.training.trainer import train as run_training  # torch-heavy: import when needed

    keep_freed_memory()  # this process is the training run: reuse the memory each step frees
    started = time.perf_counter()
    result = run_training(
        experiment,
        run_path,
        resume=resume is not None,
        progress=progress,
        log=lambda line: typer.echo(line, err=as_json),
        like=like,
    )
    if as_json:
        if os.environ.get("RANK", "0") != "0":  # under torchrun (--nproc): one object, from the main process
            return
        print_json(
            {
                "run": str(result.run),
                "steps": result.step,
                "steps_this_session": len(result.losses),
                "final_loss": result.losses[-1] if result.losses else None,
                "valid": result.final_metrics,
                "device": experiment.train.device,
                "seconds": time.perf_counter() - started,
            }
        )
        return
    _report(result.run, result.final_metrics)


def _spawn(  # noqa: PLR0913 - the command line to pass on
    nproc: int,
    config: Path | None,
    overrides: list[str],
    run_path: Path,
    resume: bool,
    progress: bool,
    as_json: bool,
    like: Path | None,
) -> None:
    """Re-run this command on N processes (attnlab.cli.processes), with a fixed --out so all ranks agree."""
    from attnlab.cli.processes import launch

    command = ["train"]
    command += ["--resume", str(run_path)] if resume else [str(config), "--out", str(run_path)]
    for item in overrides:
        command += ["--set", item]
    if like is not None:
        command += ["--like", str(like)]
    if not progress:
        command.append("--no-progress")
    if as_json:
        command.append("--json")
    launch(nproc, command)


def _report(run: Path, metrics: dict | None) -> None:
    from attnlab.cli.evaluate import FIT_KEYS, fit_line

    typer.echo(f"run: {run}")
    if metrics:
        shown = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k not in FIT_KEYS}
        typer.echo(
            "valid: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown.items())
        )
        if "trained" in metrics:
            typer.echo(fit_line(metrics))
