"""``attnlab sweep``: train one config over a grid of keys and seeds; results over seeds."""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import json_option, print_json, progress_option
from attnlab.errors import UsageError
from attnlab.limits import MAX_PROCESSES


@app.command()
def sweep(
    config: Path = typer.Argument(None, help="The experiment's TOML file (see configs/)."),
    grid: list[str] = typer.Option(
        [],
        "--grid",
        help="A key and its values: section.key=v1,v2,... (repeatable; the runs are the product); "
        "replaces that key of the file's \\[sweep.grid].",
    ),
    seeds: str = typer.Option(
        None,
        "--seeds",
        help="Seeds, e.g. 0-4 or 0,2,7; each sets train.seed and task.seed. "
        "Default: the file's \\[sweep] seeds, else 0.",
    ),
    out: Path = typer.Option(None, "--out", help="The sweep folder (run the same command again to resume it)."),
    overrides: list[str] = typer.Option([], "--set", help="Fix a key for every run: section.key=value (repeatable)."),
    jobs: int = typer.Option(
        1,
        "--jobs",
        min=1,
        max=MAX_PROCESSES,
        help="Trainings at once: 1 in this process, N > 1 in N worker processes; one thread each.",
    ),
    report: Path = typer.Option(
        None,
        "--report",
        help="Rebuild results.csv, accuracy_by_length.csv, summary.md and plots/ of this sweep folder.",
    ),
    retry_failed: bool = typer.Option(False, "--retry-failed", help="Train the runs recorded as failed again."),
    progress: bool = progress_option(),
    as_json: bool = json_option("Print one JSON object when the sweep ends: counts, seconds, files."),
) -> None:
    """Train every combination of the --grid values for every seed; write results.csv, summary.md, plots/."""
    from attnlab.sweep.execute import run_sweep  # torch-heavy: import when needed
    from attnlab.sweep.plan import plan_sweep
    from attnlab.sweep.report import write_report

    if report is not None:
        if config is not None or grid or overrides or out is not None:
            raise UsageError("--report DIR rebuilds a sweep's report: give no CONFIG, --grid, --set or --out with it")
        files = write_report(report)
        if as_json:
            print_json({"out": str(report), "files": [str(path) for path in files]})
        else:
            typer.echo(f"report: {', '.join(str(path) for path in files)}")
        return
    if config is None:
        raise UsageError(
            "give a CONFIG.toml (with --grid section.key=values or a [sweep] table) to sweep, or --report DIR"
        )
    if out is None:
        raise UsageError("--out: give the sweep folder (a new one, or this sweep's to resume it)")
    plan = plan_sweep(config, grid, seeds, overrides)
    if jobs == 1:
        from attnlab.runtime import keep_freed_memory

        keep_freed_memory()  # this process trains the runs: reuse the memory each step frees, as train does
    result = run_sweep(plan, out, jobs=jobs, progress=progress, retry_failed=retry_failed)
    if as_json:
        print_json(result.to_json())
        return
    typer.echo(
        f"sweep: {result.runs} runs in {result.out}: {result.ok} finished, {result.failed} failed "
        f"({result.trained} trained now, {result.skipped} done before) in {result.seconds:.1f} s"
    )
    typer.echo(f"summary: {result.out / 'summary.md'}; results: {result.out / 'results.csv'}")
