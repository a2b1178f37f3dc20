"""``attnlab eval``: the metrics of a trained run on one split."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from attnlab.cli.app import app
from attnlab.cli.choices import Split
from attnlab.cli.options import (
    SOURCE_HELP,
    attention_option,
    device_map_option,
    device_option,
    dtype_option,
    max_memory_option,
    offload_folder_option,
    placed,
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
from attnlab.errors import UsageError
from attnlab.limits import MAX_BATCH_SIZE


@app.command("eval")
def evaluate_run(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    split: str = typer.Option(
        Split.test.value,
        "--split",
        metavar="SPLIT",
        help="The split to evaluate on: train, valid, test, length_generalisation, or a length bin of "
        "task.eval_lengths (length_LOW_HIGH).",
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object of metrics."),
    batch_size: int = typer.Option(
        None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help="Examples per batch; default 128 (16 texts with --texts)."
    ),
    texts: Path = typer.Option(
        None,
        "--texts",
        help="Language models: the perplexity over this text file (one text per line, no EOS appended) "
        "instead of a split.",
    ),
    mask_heads: list[str] = typer.Option(None, "--mask-head", help="Mask a head, kind:layer:head (repeatable)."),
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
    attention: str | None = attention_option(),
    checkpoint: str = typer.Option(
        None,
        "--checkpoint",
        help="Evaluate this checkpoint's weights: last (the latest), best (the best recorded validation "
        "accuracy, then loss) or step-N. Default: the run's model.safetensors (the latest weights).",
    ),
    truncate: bool = typer.Option(
        None,
        "--truncate/--no-truncate",
        help="Cut examples longer than the model's context (not for recognition tasks) and say how many; "
        "--no-truncate refuses them with an error. Default: the run's train.truncate (false unless set).",
    ),
) -> None:
    """Evaluate a run: accuracy, loss, perplexity or BLEU, and accuracy per length.

    Heads held at zero in training (train.mask_heads) stay masked; --mask-head masks more.

    Every split's result also says whether the model fit its training split: trained is true when
    its accuracy on (up to 2,000 examples of) the train split is at least 0.9 (attnlab.evaluation.fit),
    so that "did not generalise" is never read where the model did not learn.

    With --texts: a language model's perplexity over a text file, the exp of
    the mean next-token negative log-likelihood over every predicted token.
    A pretrained LM reads each line as it is (its first token is context only
    unless the model adds a BOS; no EOS); an lm run trained here reads
    BOS line EOS, as it was trained, so a file scores as a split of its lines.
    The file is streamed (any size); --nproc spreads it over processes and
    --resume continues an interrupted run (state: RUN/analysis/eval-FILE.resume.json).
    """
    # Imported when the command runs: the help pages load no torch (see attnlab.cli).
    from attnlab.evaluation.evaluate import evaluate
    from attnlab.evaluation.fit import training_fit
    from attnlab.experiment import positions_seed
    from attnlab.head_ids import parse_head
    from attnlab.pretrained.sources import open_model
    from attnlab.tasks.base import SPLITS
    from attnlab.tasks.batching import count_too_long

    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    opening = dict(dtype=dtype, revision=revision, verify=verify, checkpoint=checkpoint, attention=attention)
    opening |= placed(device, device_map, max_memory, offload_folder)
    if texts is not None:
        with process_group(info):
            loaded = open_model(run, **opening)
            extra = [parse_head(spec, loaded.model) for spec in mask_heads or []]
            truncate = loaded.experiment.train.truncate if truncate is None else truncate
            identity = dict(run=str(loaded.source), dtype=dtype, revision=revision, checkpoint=checkpoint)
            metrics = _text_metrics(loaded, texts, batch_size or 16, truncate, extra, resume, info, progress, identity)
            if info.is_main:
                _echo_metrics(metrics, as_json)
        return
    loaded = open_model(run, **opening)
    names = loaded.task.split_names() if hasattr(loaded.task, "split_names") else SPLITS
    if split not in names:
        raise UsageError(f"--split: unknown split {split!r}; this run's task has {', '.join(names)}")
    train = loaded.experiment.train
    extra = [parse_head(spec, loaded.model) for spec in mask_heads or []]
    truncate = train.truncate if truncate is None else truncate
    batch_size = batch_size or 128
    max_length = train.max_length or loaded.model.config.max_len
    options = dict(
        kind=loaded.experiment.model_kind,
        batch_size=batch_size,
        max_length=max_length,
        truncate=truncate,
        tokenizer=loaded.tokenizer,
        head_mask=loaded.held_mask(extra),
        positions_seed=positions_seed(loaded.experiment),
    )
    metrics = evaluate(loaded.model, loaded.task, split, progress=progress and not as_json, **options)
    if metrics["examples"] == 0:  # evaluate built the split once and found it empty
        filled = [name for name in names if loaded.task.split(name)]
        raise UsageError(
            f"--split: the {split!r} split of this run's task has no examples; "
            f"splits with examples: {', '.join(filled) or 'none'}"
        )
    if truncate:
        cut = count_too_long(loaded.task.split(split), max_length)
        metrics["truncated"] = cut
        if cut:
            typer.echo(
                f"note: --truncate cut {cut} of {metrics['examples']} examples to the model's "
                f"context of {max_length} positions",
                err=True,
            )
    if loaded.checkpoint is not None:
        metrics["checkpoint"] = f"step-{loaded.checkpoint.step}"
    metrics.update(training_fit(loaded.model, loaded.task, **options))
    _echo_metrics(metrics, as_json)


def _text_metrics(  # noqa: PLR0913
    loaded,
    texts: Path,
    batch_size: int,
    truncate: bool,
    extra,
    resume: bool,
    info,
    progress: bool,
    identity,  # noqa: ANN001
) -> dict[str, object]:
    """Perplexity, mean NLL and counts of a language model over a text file, a corpus run
    (attnlab.analysis.corpus, attnlab.analysis.corpus_sums); its state RUN/analysis/eval-FILE.resume.json."""
    from attnlab.analysis.corpus import corpus_identity, finish, run_corpus
    from attnlab.analysis.corpus_sums import PerplexitySums, text_counts
    from attnlab.analysis.lm_probe import NextTokenLoss

    loss = NextTokenLoss(loaded, truncate=truncate, base_mask=loaded.held_mask(extra))
    state = loaded.analysis / f"eval-{texts.name}.resume.json"
    held = [str(head) for head in loaded.held_heads] + [str(head) for head in extra]
    sums = run_corpus(
        texts,
        PerplexitySums(loss),
        batch_size=batch_size,
        identity=corpus_identity(texts, command="eval", truncate=truncate, held=held, **identity),
        state=state,
        resume=resume,
        info=info,
        progress=progress,
        desc="eval",
    )
    counts = text_counts(sums, texts)
    score = loss.score(float(sums["nll"]), float(sums["tokens"]))
    if counts["truncated"] and info.is_main:
        typer.echo(
            f"note: --truncate cut {counts['truncated']} of {counts['texts'] + counts['skipped']} texts to the "
            f"model's context of {loss.context} tokens",
            err=True,
        )
    finish(state, info)
    return {
        "texts": counts["texts"],
        "tokens": counts["tokens"],
        "perplexity": score.metric,
        "loss": score.loss,
        "skipped": counts["skipped"],
        "truncated": counts["truncated"],
    }


FIT_KEYS = ("trained", "train_accuracy", "train_examples", "trained_threshold")
"""The keys of :func:`attnlab.evaluation.fit.training_fit`, shown on one line of their own."""


def _echo_metrics(metrics: dict, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps(metrics, sort_keys=True))
        return
    shown_with_accuracy = ("baseline", "baseline_accuracy", "majority_accuracy")
    for key, value in metrics.items():
        if key in shown_with_accuracy or key in FIT_KEYS:
            continue
        if key == "accuracy" and "baseline_accuracy" in metrics:  # the shortcut's score beside the model's
            typer.echo(
                f"accuracy: {value:.4f} (baseline {metrics['baseline']}: {metrics['baseline_accuracy']:.4f}, "
                f"majority class: {metrics['majority_accuracy']:.4f})"
            )
        elif key == "accuracy_by_length":
            typer.echo("accuracy by length: " + ", ".join(f"{n}:{a:.3f}" for n, a in value.items()))
        elif key == "examples_by_length":
            typer.echo("strings by length: " + ", ".join(f"{n}:{count}" for n, count in value.items()))
        else:
            typer.echo(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    if "trained" in metrics:
        typer.echo(fit_line(metrics))


def fit_line(metrics: dict) -> str:
    """``trained: true (train accuracy 0.9812 >= 0.9 on 2000 examples)``."""
    if metrics["trained"] is None:
        return "trained: unknown (the task has no training examples)"
    relation = ">=" if metrics["trained"] else "<"
    verdict = "true" if metrics["trained"] else "false (the model did not fit its training split)"
    return (
        f"trained: {verdict}: train accuracy {metrics['train_accuracy']:.4f} {relation} "
        f"{metrics['trained_threshold']:g} on {metrics['train_examples']} training examples"
    )
