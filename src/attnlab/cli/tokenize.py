"""``attnlab tokenize``: show how a tokenizer kind splits a text (Agarwal §2.1)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from attnlab.cli.app import app
from attnlab.cli.choices import TokenizerKind, value_of
from attnlab.cli.options import json_option, print_json
from attnlab.errors import UsageError
from attnlab.limits import MAX_VOCAB_SIZE

if TYPE_CHECKING:  # the tokenizers import at run time, inside the command
    from attnlab.tokenizers import Tokenizer


def _pick_tokenizer(
    text: str,
    kind: str | None,
    tokenizer: Path | None,
    vocab: Path | None,
    corpus: Path | None,
    vocab_size: int,
    skip_bad_lines: bool,
    lowercase: bool | None = None,
) -> Tokenizer:
    sources = [name for name, given in (("--tokenizer", tokenizer), ("--vocab", vocab), ("--train", corpus)) if given]
    if len(sources) > 1:
        raise UsageError(f"give at most one of --tokenizer, --vocab, --train (got {', '.join(sources)})")
    if lowercase is not None and vocab is None:
        flag = "--lowercase" if lowercase else "--no-lowercase"
        raise UsageError(f"{flag}: applies to --vocab only (a tokenizer.json carries its own normalizer)")
    # Imported when the command runs: `attnlab tokenize` and the help pages load no torch (see attnlab.cli).
    from attnlab.tokenizers import Tokenizer, train_tokenizer

    if tokenizer is not None:
        loaded = Tokenizer.load(tokenizer)
        if kind is not None and kind != loaded.kind:
            raise UsageError(f"--kind {kind}: {tokenizer} holds a {loaded.kind} tokenizer")
        return loaded
    if vocab is not None:
        if kind not in (None, "wordpiece"):
            raise UsageError(f"--vocab: a BERT vocab.txt makes a wordpiece tokenizer, not {kind}")
        return Tokenizer.from_vocab_txt(vocab, lowercase=lowercase)
    if kind is None:
        raise UsageError("--kind: required unless --tokenizer or --vocab is given")
    from attnlab.tokenizers.kinds import LEARNED_KINDS

    if corpus is None and kind in LEARNED_KINDS:
        raise UsageError(
            f"--kind {kind}: its pieces are learned from a corpus; give --train CORPUS or --tokenizer FILE "
            "(learned from TEXT alone, every word would be one token)"
        )
    if corpus is not None:
        from attnlab.tasks.text import read_lines

        lines = read_lines(corpus, skip_bad_lines=skip_bad_lines)
        if lines.skipped:
            typer.echo(f"skipped {len(lines.skipped)} bad lines in {corpus}", err=True)
        return train_tokenizer(kind, lines.items, vocab_size)
    # No vocabulary given: learn one from TEXT itself, which shows how the kind splits.
    return train_tokenizer(kind, [text], vocab_size)


@app.command("tokenize")
def tokenize(
    text: str = typer.Argument(..., help="The text to tokenize."),
    kind: TokenizerKind = typer.Option(None, "--kind", help="Tokenizer kind."),
    tokenizer: Path = typer.Option(None, "--tokenizer", help="A tokenizer.json (attnlab or Hugging Face)."),
    vocab: Path = typer.Option(None, "--vocab", help="A BERT vocab.txt (wordpiece); its casing decides (see above)."),
    lowercase: bool | None = typer.Option(
        None,
        "--lowercase/--no-lowercase",
        help="With --vocab: lowercase and strip accents, or keep case and accents, whatever the "
        "vocabulary's casing. Default: follow the vocabulary (see above).",
    ),
    train: Path = typer.Option(None, "--train", help="Train the tokenizer on this UTF-8 corpus, one text per line."),
    vocab_size: int = typer.Option(
        8000, "--vocab-size", min=7, max=MAX_VOCAB_SIZE, help="Vocabulary size when training."
    ),
    skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="Skip bad corpus lines (counted)."),
    ids: bool = typer.Option(False, "--ids", help="Print token ids instead of tokens."),
    as_json: bool = json_option("Print one JSON object: the text, the tokenizer's kind and size, tokens and ids."),
) -> None:
    """Print the tokens of TEXT as a JSON list.

    Without --tokenizer, --vocab or --train, the char, word and rule kinds learn their vocabulary
    from TEXT itself; bpe and wordpiece, whose pieces are learned from a corpus, need --train or
    --tokenizer. TEXT holds at most 20,000 characters (attnlab.limits.MAX_TEXT_CHARS).

    Casing with --vocab, as Hugging Face's BERT does: an uncased vocab.txt (lowercasing changes none
    of its pieces, [CLS]-style specials aside) lowercases TEXT and strips its accents ("Café" ->
    "cafe"); a cased one keeps case and accents. --lowercase / --no-lowercase override.

    A tokenizer.json keeps its own normalizer, but any padding or truncation it configures is
    ignored: the output is TEXT's tokens only.
    """
    from attnlab.resources import check_input_text

    check_input_text(text, what="TEXT")
    tok = _pick_tokenizer(text, value_of(kind), tokenizer, vocab, train, vocab_size, skip_bad_lines, lowercase)
    if as_json:
        print_json(
            {
                "text": text,
                "kind": tok.kind,
                "vocab_size": tok.vocab_size,
                "tokens": tok.tokenize(text),
                "ids": tok.encode(text),
            }
        )
        return
    out = tok.encode(text) if ids else tok.tokenize(text)
    typer.echo(json.dumps(out, ensure_ascii=False))
