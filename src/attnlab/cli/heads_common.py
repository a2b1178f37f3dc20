"""The ``attnlab heads`` group: its Typer app, the option texts its commands share, and what they
measure: the objective a run and its options give (:func:`command_probe`), a corpus run's sums, and
the lines every command's output starts with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from attnlab.cli.app import app
from attnlab.cli.choices import Split
from attnlab.errors import UsageError

heads_app = typer.Typer(
    help="Head analysis: ablation, importance and pruning (Michel et al.); what each head does (detect).",
    no_args_is_help=True,
)
app.add_typer(heads_app, name="heads")

SPLIT_HELP = "The split to measure on."
KIND_HELP = "Only heads of this attention kind; repeatable."
TEXTS_HELP = (
    "A text file, one text per line. Language models: the objective is the next-token loss and the "
    "metric the perplexity. Sentence encoders: the fidelity of the sentence embeddings to the unmasked "
    "model (1 - cosine). Pretrained encoder-decoders (T5, BART, ...): source<TAB>target pairs, the "
    "objective the target's cross-entropy given the source, the metric the greedy output's accuracy."
)
BATCH_HELP = "Examples per batch; default 128 (16 texts with --texts)."
PAIRS_HELP = (
    "Sentence encoders: a TSV file sentence1<TAB>sentence2<TAB>score; the metric is the Spearman "
    "correlation of the embeddings' cosine with the score."
)


def command_probe(  # noqa: ANN202
    run: Path,
    split: Split | str,
    batch_size: int | None,
    texts: Path | None = None,
    pairs: Path | None = None,
    opening: dict | None = None,
    dtype: str | None = None,
    revision: str | None = None,
    verify: bool = True,
    corpus: bool = False,
    spread: bool = False,
):
    """The objective: the run's task split; for a language model --texts (next-token loss); for a
    sentence encoder --texts (fidelity) / --pairs.

    Every probe starts from the run's held heads (train.mask_heads) switched off, as `attnlab eval` does.
    With ``corpus`` --texts is a corpus run (attnlab.analysis.corpus: streamed, on several
    processes, resumable), whose objective is a NextTokenLoss (a language model) or a FidelityLoss
    (a sentence encoder) without texts of its own; ``spread`` (--nproc or --resume given) refuses
    every other objective.
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.analysis.fidelity import FidelityLoss, FidelityProbe, PairProbe
    from attnlab.analysis.heads import TaskProbe, scoring_pairs
    from attnlab.analysis.lm_probe import NextTokenLoss, NextTokenProbe
    from attnlab.pretrained.sources import open_model

    if texts is not None and pairs is not None:
        raise UsageError("give --texts or --pairs, not both")
    split = Split(split).value
    loaded = open_model(run, dtype=dtype, revision=revision, verify=verify, **(opening or {"device": "cpu"}))
    model = loaded.experiment.model_config_class
    if texts is not None and model.reads_source_and_target:
        if spread:
            raise UsageError("--nproc and --resume: a corpus run scores a language model or a sentence encoder")
        scored = scoring_pairs(loaded, texts)
        return scored, TaskProbe(scored, split, batch_size=batch_size or 16, base_mask=loaded.held_mask())
    if texts is not None and model.language_model:
        if corpus:
            return loaded, NextTokenLoss(
                loaded, truncate=loaded.experiment.train.truncate, base_mask=loaded.held_mask()
            )
        return loaded, NextTokenProbe(
            loaded,
            texts,
            batch_size=batch_size or 16,
            truncate=loaded.experiment.train.truncate,
            base_mask=loaded.held_mask(),
        )
    if texts is not None and corpus:
        return loaded, FidelityLoss(loaded, base_mask=loaded.held_mask())
    if spread:
        raise UsageError("--nproc and --resume: only for --texts (a corpus run)")
    batch_size = batch_size or 128
    if texts is not None:
        return loaded, FidelityProbe(loaded, texts, batch_size=batch_size, base_mask=loaded.held_mask())
    if pairs is not None:
        return loaded, PairProbe(loaded, pairs, batch_size=batch_size, base_mask=loaded.held_mask())
    if model.embeds_sentences:
        raise UsageError(
            f"{run} is a sentence encoder without a task to score: give --texts FILE (embedding fidelity, "
            "no labels needed) or --pairs FILE (sentence1<TAB>sentence2<TAB>score)"
        )
    return loaded, TaskProbe(loaded, split, batch_size=batch_size, base_mask=loaded.held_mask())


def is_corpus(probe) -> bool:  # noqa: ANN001
    """Whether ``probe`` is a corpus run's loss (--texts, streamed), not a probe holding its data."""
    from attnlab.analysis.fidelity import FidelityLoss
    from attnlab.analysis.lm_probe import NextTokenLoss

    return type(probe) in (NextTokenLoss, FidelityLoss)


def corpus_sums(
    loaded,  # noqa: ANN001
    objective,  # noqa: ANN001
    texts: Path,
    command: str,
    *,
    batch_size: int | None,
    state: Path,
    resume: bool,
    info,  # noqa: ANN001
    progress: bool,
    **settings: Any,
):  # noqa: ANN202
    """The float64 sums of a corpus run over ``texts`` (attnlab.analysis.corpus.run_corpus); its
    identity, what a resumed state must match: the command, the run, its held heads and the
    ``settings`` that change the sums (dtype, revision, ...)."""
    from attnlab.analysis.corpus import corpus_identity, run_corpus
    from attnlab.analysis.corpus_sums import text_counts

    identity = corpus_identity(
        texts,
        command=f"heads {command}",
        run=str(loaded.source),
        held=[str(head) for head in loaded.held_heads],
        **objective.loss.settings(),
        **settings,
    )
    sums = run_corpus(
        texts,
        objective,
        batch_size=batch_size or 16,
        identity=identity,
        state=state,
        resume=resume,
        info=info,
        progress=progress,
        desc=command,
    )
    text_counts(sums, texts)  # refuses a file without a text to score
    return sums


def held_note(loaded) -> str | None:  # noqa: ANN001
    held = loaded.held_heads
    if not held:
        return None
    return f"held at zero by train.mask_heads (off throughout, like `attnlab eval`): {', '.join(map(str, held))}"


def json_head(loaded, probe) -> dict[str, Any]:  # noqa: ANN001
    """What every ``heads --json`` object starts with: the run, the metric, the held heads."""
    return {
        "run": loaded.source,
        "metric_name": probe.metric_name,
        "held_heads": [str(head) for head in loaded.held_heads],
    }


def json_rows(rows: list[Any]) -> list[dict[str, Any]]:
    """Dataclass rows (one per head or per percentage) as JSON objects."""
    import dataclasses

    return [dataclasses.asdict(row) for row in rows]
