"""``attnlab heads ablate`` and ``attnlab heads importance``: the metric with heads masked, and
Michel et al.'s head importance, as CSVs and heatmaps."""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.choices import HeadKind, Split, value_of
from attnlab.cli.heads_common import (
    BATCH_HELP,
    KIND_HELP,
    PAIRS_HELP,
    SPLIT_HELP,
    TEXTS_HELP,
    command_probe,
    corpus_sums,
    heads_app,
    held_note,
    is_corpus,
    json_head,
    json_rows,
)
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
from attnlab.cli.processes import (
    Nodes,
    corpus_processes,
    master_addr_option,
    master_port_option,
    nnodes_option,
    node_rank_option,
    nproc_option,
    process_group,
    resume_option,
)
from attnlab.limits import MAX_BATCH_SIZE
from attnlab.run.output_paths import check_output_path


@heads_app.command("ablate")
def ablate_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    split: Split = typer.Option(Split.valid, "--split", help=SPLIT_HELP),
    out: Path = typer.Option(None, "--out", help="Folder for the CSVs and heatmaps (default RUN/analysis)."),
    kinds: list[HeadKind] = typer.Option(None, "--kind", help=KIND_HELP),
    batch_size: int = typer.Option(None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help=BATCH_HELP),
    texts: Path = typer.Option(None, "--texts", help=TEXTS_HELP),
    pairs: Path = typer.Option(None, "--pairs", help=PAIRS_HELP),
    mean_over: Path = typer.Option(
        None,
        "--mean-over",
        help="Mean ablation: replace a head's output by its mean over this text file (one text per line) "
        "instead of zeroing it (xi_h = 0).",
    ),
    nproc: int = nproc_option(),
    resume: bool = resume_option(),
    nnodes: int = nnodes_option(),
    node_rank: int = node_rank_option(),
    master_addr: str | None = master_addr_option(),
    master_port: int = master_port_option(),
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
    """The metric and loss with each head masked alone, and with all heads of a layer but one.

    With --mean-over FILE a head is mean-ablated: its output is its mean over FILE's texts.

    --texts is a corpus run: the file is streamed (any size), every mask is
    measured on each batch, --nproc spreads it over processes and --resume continues it
    (state: FOLDER/ablation.resume.json).
    """
    from tqdm import tqdm

    from attnlab.analysis.corpus import finish
    from attnlab.analysis.heads import ablate
    from attnlab.head_ids import head_ids

    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    kinds = [value_of(kind) for kind in kinds or ()]
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded, probe = command_probe(
            run,
            split,
            batch_size,
            texts,
            pairs,
            placed(device, device_map, max_memory, offload_folder),
            dtype,
            revision,
            verify,
            True,
            nproc > 1 or resume or nnodes > 1,
        )
        folder = out or loaded.analysis
        means = None
        if mean_over is not None:
            from attnlab.analysis.patching import head_means

            means = head_means(loaded, mean_over)
        if is_corpus(probe):
            from attnlab.analysis.corpus import corpus_identity
            from attnlab.analysis.corpus_sums import AblationSums

            objective = AblationSums(probe, kinds or None, means)
            state = folder / "ablation.resume.json"
            mean_file = corpus_identity(mean_over) if mean_over is not None else None
            sums = corpus_sums(
                loaded,
                objective,
                texts,
                "ablate",
                batch_size=batch_size,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                dtype=dtype,
                revision=revision,
                kinds=kinds,
                mean_over=mean_file,
            )
            result = objective.ablation(sums)
            if not info.is_main:
                return
        else:
            state = None
            total = 2 * len(head_ids(loaded.model, kinds or None))
            with tqdm(total=total, desc="ablate", disable=not progress) as bar:
                result = ablate(probe, kinds or None, progress=lambda: bar.update(1), means=means)
        _report_ablation(loaded, probe, result, folder, means, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_ablation(loaded, probe, result, folder: Path, means, as_json: bool) -> None:  # noqa: ANN001
    """Write the ablation's CSVs and heatmaps, all in place together (a failed write leaves none),
    and print where they are."""
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.run.storage import atomic_directory

    columns = ("kind", "layer", "head", "metric", "loss", "delta")
    with atomic_directory(folder) as staging:
        write_rows(result.single, staging / "ablation.csv", columns)
        write_rows(result.keep_one, staging / "keep_one.csv", columns)
        kinds = list(dict.fromkeys(r.kind for r in result.single))
        for kind in kinds:
            head_matrix_plot(
                [r for r in result.single if r.kind == kind],
                "delta",
                staging / f"ablation_{kind}.png",
                diverging=True,
                title=f"change of {probe.metric_name} with one head {'mean-' if means else ''}ablated",
            )
    single, keep_one = folder / "ablation.csv", folder / "keep_one.csv"
    heatmaps = [folder / f"ablation_{kind}.png" for kind in kinds]
    if as_json:
        print_json(
            {
                **json_head(loaded, probe),
                "baseline": {"metric": result.baseline.metric, "loss": result.baseline.loss},
                "ablation": "mean" if means else "zero",
                "single": json_rows(result.single),
                "keep_one": json_rows(result.keep_one),
                "files": {"ablation": str(single), "keep_one": str(keep_one), "heatmaps": list(map(str, heatmaps))},
            }
        )
        return
    baseline = "with the held heads off" if loaded.held_heads else "unmasked"
    typer.echo(
        f"{baseline}: metric {result.baseline.metric:.4f} ({probe.metric_name}), loss {result.baseline.loss:.4f}"
    )
    if note := held_note(loaded):
        typer.echo(note)
    typer.echo(f"each head {'mean-ablated' if means else 'masked'} alone: {single}")
    typer.echo(f"only one head kept per layer: {keep_one}")
    for path in heatmaps:
        typer.echo(f"heatmap: {path}")


@heads_app.command("importance")
def importance_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    split: Split = typer.Option(Split.valid, "--split", help=SPLIT_HELP),
    normalize_per_layer: bool = typer.Option(
        False, "--normalize-per-layer", help="Divide each layer's scores by their l2 norm."
    ),
    out: Path = typer.Option(None, "--out", help="The CSV to write (default RUN/analysis/importance.csv)."),
    kinds: list[HeadKind] = typer.Option(None, "--kind", help=KIND_HELP),
    batch_size: int = typer.Option(None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help=BATCH_HELP),
    texts: Path = typer.Option(None, "--texts", help=TEXTS_HELP),
    pairs: Path = typer.Option(None, "--pairs", help=PAIRS_HELP),
    nproc: int = nproc_option(),
    resume: bool = resume_option(),
    nnodes: int = nnodes_option(),
    node_rank: int = node_rank_option(),
    master_addr: str | None = master_addr_option(),
    master_port: int = master_port_option(),
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
    """I_h = E_x |dL/dxi_h| for every head, from one forward and backward pass per batch.

    --texts is a corpus run: the file is streamed (any size), --nproc spreads
    it over processes and --resume continues it (state: OUT with the suffix .resume.json).
    """
    from tqdm import tqdm

    from attnlab.analysis.corpus import finish
    from attnlab.analysis.heads import importance

    if out is not None:
        check_output_path(out, kind="file", flag="--out")
        check_output_path(out.with_suffix(".png"), kind="file", flag="--out (its heatmap)")
    kinds = [value_of(kind) for kind in kinds or ()]
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded, probe = command_probe(
            run,
            split,
            batch_size,
            texts,
            pairs,
            placed(device, device_map, max_memory, offload_folder),
            dtype,
            revision,
            verify,
            True,
            nproc > 1 or resume or nnodes > 1,
        )
        path = out or loaded.analysis / "importance.csv"
        if is_corpus(probe):
            from attnlab.analysis.corpus_sums import ImportanceSums

            objective = ImportanceSums(probe)
            state = path.with_suffix(".resume.json")
            sums = corpus_sums(
                loaded,
                objective,
                texts,
                "importance",
                batch_size=batch_size,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                dtype=dtype,
                revision=revision,
            )
            rows = objective.rows(sums, normalize_per_layer=normalize_per_layer, kinds=kinds or None)
            if not info.is_main:
                return
        else:
            state = None
            with tqdm(desc="importance", unit="batch", disable=not progress) as bar:
                rows = importance(
                    probe, normalize_per_layer=normalize_per_layer, kinds=kinds or None, progress=lambda: bar.update(1)
                )
        _report_importance(loaded, probe, rows, path, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_importance(loaded, probe, rows, path: Path, as_json: bool) -> None:  # noqa: ANN001
    """Write the importances' CSV and heatmap, in place together (a failed write leaves neither),
    and print where they are and the top heads."""
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.run.storage import atomic_directory

    with atomic_directory(path.parent) as staging:
        write_rows(rows, staging / path.name, ("kind", "layer", "head", "importance"))
        head_matrix_plot(
            rows, "importance", staging / path.with_suffix(".png").name, title=f"head importance ({probe.metric_name})"
        )
    picture = path.with_suffix(".png")
    if as_json:
        print_json(
            {**json_head(loaded, probe), "importance": json_rows(rows), "csv": str(path), "heatmap": str(picture)}
        )
        return
    typer.echo(f"importance: {path}")
    typer.echo(f"heatmap: {picture}")
    for row in sorted(rows, key=lambda r: -r.importance)[:5]:
        typer.echo(f"  {row.kind}:{row.layer}:{row.head}  {row.importance:.4g}")
    if note := held_note(loaded):
        typer.echo(f"{note} (importance 0)")
