"""``attnlab attention``: attention heatmaps of a trained run on one input, as PNG files.

"Visualising learned attentions: different heads show different patterns" (Li's slides). One
picture per head of each layer of each attention kind, one grid per layer, and for hard-attention
models the argmax pattern. The same pictures come from Python through
:func:`attnlab.analysis.plots.attention_figures`.
"""

from __future__ import annotations

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
from attnlab.limits import MAX_NEW_TOKENS


@app.command()
def attention(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    text: str = typer.Argument(..., help="The input: symbols of the task (e.g. abcd) or text."),
    out: Path = typer.Option(..., "--out", help="Folder to write the PNG files into (created if missing)."),
    argmax: bool | None = typer.Option(
        None, "--argmax/--no-argmax", help="Draw the argmax pattern (default: only for hard attention)."
    ),
    max_length: int = typer.Option(
        64, "--max-length", min=1, max=MAX_NEW_TOKENS, help=f"Most output tokens to decode (at most {MAX_NEW_TOKENS})."
    ),
    continuation: bool = typer.Option(
        False,
        "--continuation/--prompt-only",
        help="Language models: draw the greedy continuation's rows and columns too (default: the prompt only).",
    ),
    layers: str | None = typer.Option(
        None, "--layers", help="Only these layers, e.g. 0,5,29 or 0-3 or 0,10-12 (default: every layer)."
    ),
    device: str = device_option(),
    device_map: str | None = device_map_option(),
    max_memory: str | None = max_memory_option(),
    offload_folder: Path | None = offload_folder_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option("Print one JSON object: input, output, held heads and the pictures written."),
) -> None:
    """Draw every attention map of RUN on TEXT: per head, per layer (grid), and the argmax pattern.

    Heads held at zero in training (train.mask_heads) are off, as in `attnlab eval`; their maps are
    still drawn, titled "(off)". --layers draws only some layers (a 30-layer model has 300 pictures).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.analysis.maps import attention_view
    from attnlab.analysis.plots import save_attention_pictures, select_layers
    from attnlab.pretrained.sources import open_model
    from attnlab.resources import check_input_text
    from attnlab.run.output_paths import check_output_path

    check_input_text(text, what="TEXT")
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
            tokens=len(text) + max_length + 2,  # a text has no more tokens than characters
            cached=("*.pattern", "*.z"),  # every map and head output of the view
        ),
    )
    chosen = None if layers is None else select_layers(layers, _deepest(loaded.model.config), flag="--layers")
    view = attention_view(loaded, text, max_length=max_length, continuation=continuation)
    hard = loaded.experiment.model.get("attention") == "hard"
    paths = save_attention_pictures(view, out, argmax=hard if argmax is None else argmax, layers=chosen)
    if as_json:
        print_json(
            {
                "run": str(run),
                "input": text,
                "output": view.output,
                "held_heads": [str(head) for head in loaded.held_heads],
                "out": str(out),
                "pictures": [str(path) for path in paths],
            }
        )
        return
    typer.echo(f"{text} -> {view.output}")
    if loaded.held_heads:
        typer.echo(f"held at zero by train.mask_heads (off): {', '.join(map(str, loaded.held_heads))}")
    typer.echo(f"wrote {len(paths)} attention pictures to {out}")


def _deepest(config) -> int:  # noqa: ANN001
    """The most layers any attention kind of the model has (encoder or decoder side)."""
    return max(config.layers, getattr(config, "decoder_depth", 0))
