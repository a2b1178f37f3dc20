"""``attnlab encode``: tokens, last hidden states and sentence embedding of texts (encoder runs)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import (
    SOURCE_HELP,
    device_map_option,
    device_option,
    dtype_option,
    max_memory_option,
    offload_folder_option,
    placed,
    revision_option,
    verify_option,
)
from attnlab.limits import MAX_BATCH_SIZE

SHOWN = 6
"""Values per vector in the human-readable output (``--json`` has them all)."""


@app.command()
def encode(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    texts: list[str] = typer.Argument(..., help="One or more texts."),
    as_json: bool = typer.Option(False, "--json", help="Print every value as JSON."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, max=MAX_BATCH_SIZE, help="Texts per batch."),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
) -> None:
    """For each text: its WordPiece tokens, the last hidden states (T x d) and the sentence embedding."""
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.pretrained.sources import open_model
    from attnlab.resources import check_input_text
    from attnlab.sentence_embedding import encode_texts

    for number, text in enumerate(texts, start=1):
        check_input_text(text, what="TEXT" if len(texts) == 1 else f"TEXT {number}")
    loaded = open_model(
        run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
    )
    results = encode_texts(loaded, texts, batch_size=batch_size)
    pooling = loaded.experiment.task.get("pooling", "mean")
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "run": str(run),
                    "pooling": pooling,
                    "texts": [
                        {
                            "text": r.text,
                            "tokens": r.tokens,
                            "hidden": r.hidden.tolist(),
                            "embedding": r.embedding.tolist(),
                        }
                        for r in results
                    ],
                }
            )
        )
        return
    for r in results:
        length, width = r.hidden.shape
        typer.echo(f"text: {r.text}")
        typer.echo(f"tokens ({length}): {' '.join(r.tokens)}")
        typer.echo(f"last hidden states ({length} x {width}):")
        for token, row in zip(r.tokens, r.hidden, strict=True):
            typer.echo(f"  {token:>12}  {_vector(row)}")
        typer.echo(f"sentence embedding ({pooling} pooling, {width}): {_vector(r.embedding)}")
        typer.echo("")


def _vector(values) -> str:  # noqa: ANN001
    shown = " ".join(f"{float(v):+.4f}" for v in values[:SHOWN])
    return shown + (f" ... ({len(values)} values; --json prints all)" if len(values) > SHOWN else "")
