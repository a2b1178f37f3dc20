"""``attnlab patch``: activation patching of every head and the residual stream, clean into corrupt."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    device_option,
    dtype_option,
    json_option,
    print_json,
    progress_option,
    revision_option,
    verify_option,
)
from attnlab.errors import UsageError
from attnlab.run.output_paths import check_output_path

SITES = ("heads", "residual")


@app.command("patch")
def patch_command(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    clean: str = typer.Option(..., "--clean", help="The clean input, whose output patches restore."),
    corrupt: str = typer.Option(..., "--corrupt", help="The corrupt input: as many tokens as --clean."),
    metric: str = typer.Option(
        "logit_diff",
        "--metric",
        help="Language models: logit_diff (logit of --answer minus --wrong at the last position) or loss "
        "(log-probability of --answer there).",
    ),
    answer: str = typer.Option(
        None, "--answer", help="Language models: the clean input's next token (default: its top token)."
    ),
    wrong: str = typer.Option(
        None, "--wrong", help="Language models: the corrupt input's next token (default: its top token)."
    ),
    sites: list[str] = typer.Option(
        None,
        "--site",
        help="heads (each head's output) or residual (each layer and position); repeatable; default both.",
    ),
    out: Path = typer.Option(None, "--out", help="Folder for the CSVs and heatmaps (default RUN/analysis/patching)."),
    progress: bool = progress_option(),
    device: str = device_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """How much of the clean-vs-corrupt difference patching each site restores.

    Runs the model on both inputs, then on the corrupt one with one site taken from the clean run:
    every head's output (all positions) and the residual stream entering every layer (and leaving the
    last), position by position. restored = (m_patched - m_corrupt) / (m_clean - m_corrupt).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from tqdm import tqdm

    from attnlab.analysis.patching import patch, patch_steps
    from attnlab.analysis.reports import head_matrix_plot, position_matrix_plot, write_rows
    from attnlab.head_ids import HeadId
    from attnlab.pretrained.sources import open_model

    chosen = list(dict.fromkeys(sites or SITES))
    unknown = [s for s in chosen if s not in SITES]
    if unknown:
        raise UsageError(f"--site: unknown {unknown[0]!r}; allowed: {', '.join(SITES)}")
    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    loaded = open_model(run, device=device, dtype=dtype, revision=revision, verify=verify)
    heads, residual = "heads" in chosen, "residual" in chosen
    bars: list[tqdm] = []  # opened at the first patch, after every input check has passed

    def tick() -> None:
        if not bars:
            bars.append(
                tqdm(total=patch_steps(loaded, heads=heads, residual=residual), desc="patch", disable=not progress)
            )
        bars[0].update(1)

    try:
        result = patch(
            loaded,
            clean,
            corrupt,
            metric=metric,
            answer=answer,
            wrong=wrong,
            heads=heads,
            residual=residual,
            progress=tick,
        )
    finally:
        for bar in bars:
            bar.close()
    folder = out or loaded.analysis / "patching"
    files: dict[str, str] = {}
    if heads:
        files["heads"] = str(
            write_rows(result.heads, folder / "heads.csv", ("kind", "layer", "head", "restored", "metric"))
        )
        files["heads_heatmap"] = str(
            head_matrix_plot(
                result.heads, "restored", folder / "heads.png", diverging=True, title="restored by patching each head"
            )
        )
    if residual:
        columns = ("layer", "site", "position", "token", "restored", "metric")
        files["residual"] = str(write_rows(result.residual, folder / "residual.csv", columns))
        files["residual_heatmap"] = str(
            position_matrix_plot(
                result.residual,
                "restored",
                folder / "residual.png",
                tokens=result.corrupt_tokens,
                title="restored by patching the residual stream at one position",
            )
        )
    if as_json:
        print_json(
            {
                "run": str(run),
                "measure": result.measure,
                "metric_clean": result.metric_clean,
                "metric_corrupt": result.metric_corrupt,
                "clean_tokens": result.clean_tokens,
                "corrupt_tokens": result.corrupt_tokens,
                "heads": [dataclasses.asdict(r) for r in result.heads],
                "residual": [dataclasses.asdict(r) for r in result.residual],
                "files": files,
            }
        )
        return
    typer.echo(f"measured: {result.measure}")
    typer.echo(f"clean {result.metric_clean:.4f}, corrupt {result.metric_corrupt:.4f}")
    top_heads = sorted(result.heads, key=lambda r: -r.restored)[:5]
    if top_heads:
        typer.echo(
            "heads restoring most: "
            + ", ".join(f"{HeadId(r.kind, r.layer, r.head)} {r.restored:+.3f}" for r in top_heads)
        )
    top_positions = sorted(result.residual, key=lambda r: -r.restored)[:5]
    if top_positions:
        typer.echo(
            "residual restoring most: "
            + ", ".join(f"{r.site} {r.layer} at {r.position} ({r.token!r}) {r.restored:+.3f}" for r in top_positions)
        )
    for name, path in files.items():
        typer.echo(f"{name}: {path}")
