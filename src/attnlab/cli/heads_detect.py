"""``attnlab heads detect``: every head scored for the patterns papers name (previous-token,
duplicate-token, induction, BOS, positional)."""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.heads_common import heads_app
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


@heads_app.command("detect")
def detect_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    texts: Path = typer.Option(
        None,
        "--texts",
        help="A text file, one text per line (each read alone): previous-token, BOS and positional scores are "
        "measured on it (streamed, any size); duplicate-token and induction always on repeated random tokens.",
    ),
    out: Path = typer.Option(
        None, "--out", help="Folder for detect.csv and the heatmaps (default RUN/analysis/detect)."
    ),
    length: int = typer.Option(
        None,
        "--length",
        min=2,
        max=4096,
        help="Random tokens per sequence, before it repeats; default 50 (fewer where the context is shorter).",
    ),
    batch_size: int = typer.Option(
        8, "--batch-size", min=1, max=MAX_BATCH_SIZE, help="Random sequences, and --texts texts per batch."
    ),
    window: int = typer.Option(4, "--window", min=0, max=64, help="Largest relative offset of a positional head."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**31 - 1, help="Seed of the random tokens."),
    top: int = typer.Option(3, "--top", min=1, max=100, help="Heads named per pattern."),
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
    """Score every head for the patterns papers name: previous-token, duplicate-token, induction,
    BOS (attention sink) and positional.

    A score is the head's mean attention on the pattern's targets (1: all of it). Induction is
    Olsson et al.'s: on random tokens repeated twice, attention from the second half to the token
    after the first occurrence. Positional: the best fixed relative offset other than -1.

    --texts is a corpus run: the file is streamed (any size), --nproc spreads it over processes
    and --resume continues it (state: FOLDER/detect.resume.json); the random sequences are
    measured on the first process.
    """
    from attnlab.analysis.corpus import corpus_identity, finish, run_corpus
    from attnlab.analysis.detectors import ON_TEXTS, DetectSums, repeated_random, score_heads
    from attnlab.pretrained.sources import open_model

    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded = open_model(
            run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
        )
        folder = out or loaded.analysis / "detect"
        random = repeated_random(loaded, length=length, batch=batch_size, seed=seed)  # checked before any pass
        sums, state = None, None
        if texts is not None:
            state = folder / "detect.resume.json"
            identity = corpus_identity(
                texts,
                command="heads detect",
                run=str(loaded.source),
                held=[str(head) for head in loaded.held_heads],
                window=window,
                dtype=dtype,
                revision=revision,
            )
            sums = run_corpus(
                texts,
                DetectSums(loaded, ON_TEXTS, window=window),
                batch_size=batch_size,
                identity=identity,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                desc="detect",
            )
            if not info.is_main:
                return
        detection = score_heads(loaded, random, sums, window=window, texts=texts)
        _report_detection(loaded, detection, folder, top, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_detection(loaded, detection, folder: Path, top: int, as_json: bool) -> None:  # noqa: ANN001
    """Write the scores' CSV and a heatmap per pattern, and name the top heads."""
    import math
    from dataclasses import asdict

    from attnlab.analysis.detectors import PATTERNS
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.head_ids import HeadId
    from attnlab.run.storage import atomic_directory

    columns = ("kind", "layer", "head", *PATTERNS, "positional_offset")
    heatmaps = {}
    with atomic_directory(folder) as staging:  # the folder in place once complete (a failed write leaves none)
        write_rows(detection.rows, staging / "detect.csv", columns)
        for name, pattern in PATTERNS.items():
            scored = [row for row in detection.rows if not math.isnan(getattr(row, name))]
            if scored:
                picture = head_matrix_plot(
                    scored, name, staging / f"detect_{name}.png", title=f"{name}: {pattern.what}"
                )
                heatmaps[name] = folder / picture.name
    table = folder / "detect.csv"
    top_heads = {name: detection.top(name, top) for name in PATTERNS}
    if as_json:
        print_json(
            {
                "run": loaded.source,
                "measured_on": detection.measured_on,
                "notes": detection.notes,
                "heads": [  # a score not measured (NaN in the CSV) is null
                    {key: None if isinstance(v, float) and math.isnan(v) else v for key, v in asdict(row).items()}
                    for row in detection.rows
                ],
                "top": {name: [str(HeadId(r.kind, r.layer, r.head)) for r in rows] for name, rows in top_heads.items()},
                "files": {"csv": str(table), "heatmaps": {name: str(path) for name, path in heatmaps.items()}},
            }
        )
        return
    for name, rows in top_heads.items():
        if not rows:
            continue
        named = ", ".join(
            f"{HeadId(r.kind, r.layer, r.head)} {getattr(r, name):.2f}"
            + (f" (offset {r.positional_offset:+d})" if name == "positional" else "")
            for r in rows
        )
        typer.echo(f"{name} ({detection.measured_on[name]}): {named}")
    for note in detection.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"scores: {table}")
    for path in heatmaps.values():
        typer.echo(f"heatmap: {path}")
