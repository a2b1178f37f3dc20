"""``attnlab verify``: check a run directory's files against its manifests."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.errors import CheckpointError


@app.command("verify")
def verify(
    run: Path = typer.Argument(..., help="A run directory."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: files, problems, warnings."),
) -> None:
    """Check every file of a run against its manifests (size and SHA-256): config, tokenizer, weights,
    checkpoint pointer, metrics and every checkpoint. Exit 0 when all is well, 3 when anything is
    damaged, missing or unreadable (each such file is named with what differs).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.run.verification import verify_run

    report = verify_run(run)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), sort_keys=True))
    else:
        for message in report.warnings:
            typer.echo(f"warning: {message}", err=True)
        for check in report.files:
            typer.echo(f"{check.status:10} {check.path}" + (f": {check.detail}" if check.detail else ""))
    problems = report.problems
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CheckpointError(f"{report.run}: {len(problems)} damaged file(s): {problems[0].detail}{more}")
    if not as_json:
        typer.echo(f"{report.run}: {len(report.files)} files checked, no problems")
