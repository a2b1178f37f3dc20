"""``attnlab patch``: activation patching, exact or by attribution, of any named site, clean into corrupt."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    device_map_option,
    device_option,
    dtype_option,
    json_option,
    max_memory_option,
    offload_folder_option,
    placed,
    print_json,
    progress_option,
    revision_option,
    verify_option,
)
from attnlab.limits import MAX_BATCH_SIZE
from attnlab.run.output_paths import check_output_path

MAX_VERIFY_TOP = 1_000_000
"""The most units --verify-top patches exactly (a cap, as every numeric option has)."""

COLUMNS = ("site", "kind", "layer", "head", "position", "token", "restored", "metric", "exact")
"""The columns of a group's CSV, those that are empty for every row left out."""


@app.command("patch")
def patch_command(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    clean: str = typer.Option(..., "--clean", help="The clean input, whose output patches restore."),
    corrupt: str = typer.Option(..., "--corrupt", help="The corrupt input: as many tokens as --clean."),
    metric: str = typer.Option(
        "logit_diff",
        "--metric",
        help="Language models: logit_diff (logit of --answer minus --wrong at the last position), loss "
        "(log-probability of the one-token --answer there) or logprob (the summed log-probability of the "
        "--answer text's tokens, teacher-forced after the prompt).",
    ),
    answer: str = typer.Option(
        None,
        "--answer",
        help="Language models: the clean input's next token (default: its top token); for --metric logprob, "
        "a text of one or more tokens.",
    ),
    wrong: str = typer.Option(
        None, "--wrong", help="Language models: the corrupt input's next token (default: its top token)."
    ),
    sites: list[str] = typer.Option(
        None,
        "--site",
        help="heads (each head's attn.z), residual (the residual stream entering each layer and leaving the "
        "last) or any site name or glob of `attnlab sites`, e.g. '*.ffn.out'; repeatable; default heads and "
        "residual. Each gives a CSV and a heatmap.",
    ),
    positions: str = typer.Option(
        None,
        "--positions",
        help="all (each head or site over all positions at once) or each (position by position); default: "
        "all for sites with heads, each for the others.",
    ),
    method: str = typer.Option(
        "exact",
        "--method",
        help="exact (one forward pass per patch, batched) or attribution (every patch estimated at once "
        "from one backward pass: (clean - corrupt) . d metric / d activation).",
    ),
    verify_top: int = typer.Option(
        10,
        "--verify-top",
        min=0,
        max=MAX_VERIFY_TOP,
        help="With --method attribution: patch exactly this many patches of each --site, those with the "
        "largest |estimate| (the column exact).",
    ),
    batch_size: int = typer.Option(
        64,
        "--batch-size",
        min=1,
        max=MAX_BATCH_SIZE,
        help="Patches in one forward pass (each a copy of the corrupt input's activations: lower it to "
        "use less memory; 1 is TransformerLens' one pass per patch).",
    ),
    out: Path = typer.Option(None, "--out", help="Folder for the CSVs and heatmaps (default RUN/analysis/patching)."),
    progress: bool = progress_option(),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """How much of the clean-vs-corrupt difference patching each site restores.

    Runs the model on both inputs, then on the corrupt one with one site's slice taken from the clean
    run: by default every head's output (all positions) and the residual stream entering every layer
    (and leaving the last), position by position. restored = (m_patched - m_corrupt) / (m_clean -
    m_corrupt); --method attribution estimates it for every patch from one backward pass.
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.analysis.patching import NAMED_SITES, check_choices
    from attnlab.lm import LanguageModel
    from attnlab.pretrained.sources import open_model
    from attnlab.run.storage import atomic_directory

    check_choices(metric, method, positions, verify_top)
    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    loaded = open_model(
        run,
        dtype=dtype,
        revision=revision,
        verify=verify,
        **placed(
            device,
            device_map,
            max_memory,
            offload_folder,
            tokens=max(len(clean), len(corrupt)) + 2,  # a text has no more tokens than characters
            cached=_cached_sites(sites),
        ),
    )
    result = LanguageModel(loaded).patch(
        clean,
        corrupt,
        metric=metric,
        answer=answer,
        wrong=wrong,
        sites=list(dict.fromkeys(sites or NAMED_SITES)),
        positions=positions,
        method=method,
        verify_top=verify_top,
        batch_size=batch_size,
        progress=progress,
    )
    folder = out or loaded.analysis / "patching"
    files: dict[str, str] = {}
    with atomic_directory(folder) as staging:  # the folder in place once complete (a failed write leaves none)
        for request, rows in result.groups.items():
            stem = _file_stem(request)
            files[stem] = str(folder / _write_csv(rows, staging / f"{stem}.csv", result.method).name)
            files[f"{stem}_heatmap"] = str(folder / _heatmap(rows, staging / f"{stem}.png", request, result).name)
    if as_json:
        print_json(
            {
                "run": str(run),
                "measure": result.measure,
                "method": result.method,
                "metric_clean": result.metric_clean,
                "metric_corrupt": result.metric_corrupt,
                "clean_tokens": result.clean_tokens,
                "corrupt_tokens": result.corrupt_tokens,
                "groups": {request: [dataclasses.asdict(r) for r in rows] for request, rows in result.groups.items()},
                "files": files,
            }
        )
        return
    typer.echo(f"measured: {result.measure}")
    typer.echo(f"clean {result.metric_clean:.4f}, corrupt {result.metric_corrupt:.4f}")
    if result.method == "attribution":
        typer.echo(f"attribution patching: first-order estimates; (exact ...) for the {verify_top} largest of each")
    for request, rows in result.groups.items():
        top = sorted(rows, key=lambda r: -r.restored)[:5]
        typer.echo(
            f"{request} restoring most: "
            + ", ".join(
                f"{_label(r)} {r.restored:+.3f}" + ("" if r.exact is None else f" (exact {r.exact:+.3f})") for r in top
            )
        )
    for name, path in files.items():
        typer.echo(f"{name}: {path}")


def _file_stem(request: str) -> str:
    """A request as a file name: ``heads``, ``residual``, a glob with ``*`` as ``all`` (``all.ffn.out``)."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", request.replace("*", "all")).strip(".") or "sites"


def _label(row: Any) -> str:
    """A row for people: ``self:3:1`` for a head's z, else ``resid_pre 2 at 4 ('key')``."""
    from attnlab.head_ids import HeadId  # lazy, as in the command: the help pages load no torch

    if row.point.endswith(".z") and row.head is not None and row.position is None:
        return str(HeadId(row.kind, row.layer, row.head))
    text = row.point if row.layer is None else f"{row.point} {row.layer}"
    text += "" if row.head is None else f" head {row.head}"
    return text + ("" if row.position is None else f" at {row.position} ({row.token!r})")


def _write_csv(rows: list[Any], path: Path, method: str) -> Path:
    """The rows with the columns that some row fills, and ``exact`` for attribution patching (an
    empty cell where a row has none)."""
    from attnlab.analysis.reports import write_rows  # lazy, as in the command

    kept = {"exact"} if method == "attribution" else set()
    columns = [c for c in COLUMNS if c in kept or any(getattr(r, c) is not None for r in rows)]
    cells = [dataclasses.replace(r, **{c: "" for c in columns if getattr(r, c) is None}) for r in rows]
    return write_rows(cells, path, columns)


def _heatmap(rows: list[Any], path: Path, request: str, result: Any) -> Path:
    """Layers x heads (a panel per attention kind, and per point when a request has several) for
    heads over all positions; otherwise sites down, positions across."""
    from types import SimpleNamespace  # lazy, as the plotting imports below

    from attnlab.analysis.reports import head_matrix_plot, position_matrix_plot  # lazy, as in the command

    how = "restored (attribution)" if result.method == "attribution" else "restored"
    named = {"heads": "", "residual": " the residual stream at one position"}  # the titles they always had
    what = named.get(request, f" {request}")
    if rows and all(r.head is not None and r.position is None and r.layer is not None for r in rows):
        several = len({r.point for r in rows}) > 1
        cells = [
            SimpleNamespace(
                kind=f"{r.kind or ''} {r.point}" if several else r.kind or r.point,
                layer=r.layer,
                head=r.head,
                restored=r.restored,
            )
            for r in rows
        ]
        return head_matrix_plot(
            cells,
            "restored",
            path,
            diverging=True,
            title=f"{how} by patching each head" if request == "heads" else f"{how}: {request}",
        )
    each = any(r.position is not None for r in rows)
    cells = [
        SimpleNamespace(
            layer="" if r.layer is None else r.layer,
            site=r.point + ("" if r.head is None else f" head {r.head}"),
            position=r.position or 0,
            restored=r.restored,
        )
        for r in rows
    ]
    tokens = result.corrupt_tokens if each else ["all positions"]
    return position_matrix_plot(cells, "restored", path, tokens=tokens, title=f"{how} by patching{what}")


def _cached_sites(sites: list[str] | None) -> tuple[str, ...]:
    """The site globs the clean run caches for the --site requests (a placement's budget holds them)."""
    named = {"heads": ("*.attn.z",), "residual": ("*.resid_pre", "*.resid_post")}
    return tuple(glob for site in sites or ["heads", "residual"] for glob in named.get(site, (site,)))
