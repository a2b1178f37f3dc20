"""``attnlab info``: the environment and the variants this build offers."""

from __future__ import annotations

import json

import typer

from attnlab import __version__
from attnlab.cli.app import app


@app.command()
def info(as_json: bool = typer.Option(False, "--json", help="Print one JSON object.")) -> None:
    """Show versions, threads, devices and the registered model variants."""
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    import torch

    from attnlab.nn import ACTIVATIONS, MODELS, NORMALIZERS, POSITIONAL, SCORES

    facts = {
        "attnlab": __version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "models": sorted(MODELS),
        "scores": sorted(SCORES),
        "normalizers": sorted(NORMALIZERS),
        "positional": sorted(POSITIONAL),
        "activations": sorted(ACTIVATIONS),
    }
    if as_json:
        typer.echo(json.dumps(facts))
        return
    for key, value in facts.items():
        typer.echo(f"{key:12} {', '.join(value) if isinstance(value, list) else value}")
