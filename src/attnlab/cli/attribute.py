"""``attnlab attribute``: direct logit attribution and the logit lens for one prompt and answer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

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
    revision_option,
    verify_option,
)
from attnlab.run.output_paths import check_output_path


@app.command("attribute")
def attribute_command(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    text: str = typer.Argument(..., help="The prompt; its next token is attributed."),
    answer: str = typer.Option(..., "--answer", help="The next token whose logit is decomposed (one token)."),
    wrong: str = typer.Option(
        None, "--wrong", help="Another token (one token): decompose logit\\[answer] - logit\\[wrong] instead."
    ),
    top_k: int = typer.Option(5, "--top-k", min=1, max=100, help="Tokens the logit lens lists per layer."),
    out: Path = typer.Option(None, "--out", help="Folder for the CSVs and pictures (default RUN/analysis/attribute)."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """Each head's and layer's direct contribution to the answer's logit, and the logit lens.

    Direct logit attribution: the residual stream at the last position is a sum of the embeddings,
    every head's output through W^O, the attention biases and the FFN outputs; with the final norm's
    scale frozen at this run (as is standard), the answer's logit is the sum of their products with
    the unembedding's direction, plus the final norm's and unembedding's biases, exactly. The logit
    lens reads the next-token distribution from the residual stream entering every layer.
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.head_ids import HeadId
    from attnlab.lm import LanguageModel
    from attnlab.pretrained.sources import open_model
    from attnlab.run.storage import atomic_directory

    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    loaded = open_model(
        run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
    )
    attribution = LanguageModel(loaded).attribute(text, answer, wrong, top_k=top_k)
    lens = attribution.lens
    folder = out or loaded.analysis / "attribute"
    with atomic_directory(folder) as staging:  # the folder in place once complete (a failed write leaves none)
        written = _write_files(attribution, staging)
    files = {name: folder / path.name for name, path in written.items()}
    if as_json:
        print_json(
            {
                "run": loaded.source,
                "measure": attribution.measure,
                "tokens": attribution.tokens,
                "value": attribution.value,
                "total": attribution.total,
                "terms": [dataclasses.asdict(t) for t in attribution.terms],
                "heads": [dataclasses.asdict(h) for h in attribution.heads],
                "layers": [dataclasses.asdict(layer) for layer in attribution.layers],
                "logit_lens": [dataclasses.asdict(row) for row in lens.rows],
                "files": {name: str(path) for name, path in files.items()},
            }
        )
        return
    typer.echo(f"{attribution.measure} at the last position: {attribution.value:.4f}")
    typer.echo(
        f"sum of the direct contributions (the final norm's scale frozen at this run): {attribution.total:.4f}"
        + ("" if abs(attribution.total - attribution.value) < 1e-3 else " (before the logits' soft cap)")
    )
    ranked = sorted(attribution.heads, key=lambda h: -abs(h.contribution))[:5]
    typer.echo(
        "heads contributing most: "
        + ", ".join(f"{HeadId(h.kind, h.layer, h.head)} {h.contribution:+.3f}" for h in ranked)
    )
    others = [t for t in attribution.terms if ".attn.head." not in t.term]
    typer.echo(
        "largest other terms: "
        + ", ".join(f"{t.term} {t.contribution:+.3f}" for t in sorted(others, key=lambda t: -abs(t.contribution))[:5])
    )
    first = next((row for row in lens.rows if row.answer_rank == 1), None)
    where = f"{first.site} {first.layer}" if first is not None else "no layer"
    typer.echo(f"logit lens: {lens.answer!r} first ranks first at {where}; the output: {lens.rows[-1].top}")
    for name, path in files.items():
        typer.echo(f"{name}: {path}")


def _write_files(attribution, staging: Path) -> dict[str, Path]:  # noqa: ANN001
    """Write the attribution's CSVs and pictures into ``staging``; their paths by name."""
    import numpy as np  # lazy, as in the command: the help pages load no torch

    from attnlab.analysis.reports import head_matrix_plot, layer_bars_plot, token_grid_plot, write_rows

    lens = attribution.lens
    return {
        "terms": write_rows(attribution.terms, staging / "terms.csv", ("term", "contribution")),
        "heads": write_rows(attribution.heads, staging / "heads.csv", ("kind", "layer", "head", "contribution")),
        "layers": write_rows(attribution.layers, staging / "layers.csv", ("layer", "attention", "ffn")),
        "lens": write_rows(
            lens.rows,
            staging / "logit_lens.csv",
            ("layer", "site", "answer_rank", "answer_probability", "answer_logit", "top"),
        ),
        "heads_heatmap": head_matrix_plot(
            attribution.heads,
            "contribution",
            staging / "heads.png",
            diverging=True,
            title=f"direct contribution of each head to {attribution.measure}",
        ),
        "layers_plot": layer_bars_plot(
            attribution.layers,
            ("attention", "ffn"),
            staging / "layers.png",
            title=f"direct contribution of each layer to {attribution.measure}",
            ylabel="contribution",
        ),
        "lens_plot": token_grid_plot(
            lens.top_tokens,
            np.asarray(lens.top_probabilities),
            staging / "logit_lens.png",
            rows=[f"{row.site} {row.layer}" for row in lens.rows],
            columns=lens.tokens,
            title="logit lens: the most likely next token read from each residual stream",
            colorbar="its probability",
        ),
    }
