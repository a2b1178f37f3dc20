"""``attnlab word2vec``: train skip-gram word vectors on a corpus (Agarwal §2.2)."""

from __future__ import annotations

from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.options import json_option, print_json, progress_option
from attnlab.limits import MAX_EPOCHS, MAX_MIN_COUNT, MAX_SEED, MAX_VECTOR_DIM, MAX_WINDOW
from attnlab.run.output_paths import check_output_path


@app.command("word2vec")
def word2vec(
    corpus: Path = typer.Argument(..., help="UTF-8 text, one sentence per line."),
    dim: int = typer.Option(
        ...,
        "--dim",
        min=1,
        max=MAX_VECTOR_DIM,
        help=f"Vector width (use the model's d_model; at most {MAX_VECTOR_DIM:,}).",
    ),
    out: Path = typer.Option(..., "--out", help="Where to write the vectors (word2vec text format)."),
    tokenizer: Path = typer.Option(
        None, "--tokenizer", help="Split lines with this tokenizer.json; default: whitespace."
    ),
    window: int = typer.Option(5, "--window", min=1, max=MAX_WINDOW, help="Context words on each side."),
    epochs: int = typer.Option(5, "--epochs", min=1, max=MAX_EPOCHS, help="Passes over the corpus."),
    min_count: int = typer.Option(1, "--min-count", min=1, max=MAX_MIN_COUNT, help="Ignore rarer words."),
    seed: int = typer.Option(0, "--seed", min=0, max=MAX_SEED, help="Random seed."),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip bad lines (counted)."),
    progress: bool = progress_option(
        "Show a progress bar while tokenizing a corpus of 10,000 lines or more (on stderr)."
    ),
    as_json: bool = json_option(),
) -> None:
    """Train skip-gram word2vec vectors with gensim and write them to --out."""
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from tqdm import tqdm

    from attnlab.embeddings import save_vectors, train_word2vec
    from attnlab.tasks.text import read_lines
    from attnlab.tokenizers import Tokenizer

    check_output_path(out, kind="file", flag="--out")
    lines = read_lines(corpus, skip_bad_lines=skip_bad_lines)
    if lines.skipped:
        typer.echo(f"skipped {len(lines.skipped)} bad lines in {corpus}", err=True)
    split = Tokenizer.load(tokenizer).tokenize if tokenizer is not None else str.split
    sentences = [
        split(line) for line in tqdm(lines.items, desc="tokenizing", disable=not progress or len(lines.items) < 10_000)
    ]
    vectors = train_word2vec(sentences, dim, window=window, min_count=min_count, epochs=epochs, seed=seed)
    left_out = save_vectors(vectors, out)
    tokens = sum(len(s) for s in sentences)
    if as_json:
        print_json(
            {
                "out": str(out),
                "words": len(vectors) - len(left_out),
                "dim": vectors.dim,
                "lines": len(sentences),
                "tokens": tokens,
                "skipped_lines": len(lines.skipped),
                "left_out": left_out,
            }
        )
        return
    typer.echo(
        f"{len(vectors) - len(left_out)} words x {vectors.dim} dims "
        f"from {len(sentences)} lines ({tokens} tokens) -> {out}"
    )
    if left_out:
        shown = ", ".join(repr(word) for word in left_out[:5]) + (", ..." if len(left_out) > 5 else "")
        typer.echo(
            f"left out {len(left_out)} tokens that hold a space or a line break, which the word2vec text "
            f"format cannot store: {shown}",
            err=True,
        )
