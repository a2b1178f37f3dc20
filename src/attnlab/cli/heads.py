"""``attnlab heads ablate | importance | prune | detect``: which heads matter, how many can go
(Michel et al.), and what each head does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from attnlab.cli.app import ClassicCommand, ClassicOption, app
from attnlab.cli.choices import HeadKind, Split, value_of
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
from attnlab.limits import MAX_BATCH_SIZE, MAX_STEPS
from attnlab.run.output_paths import check_output_path

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


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class ManyValuesOption(ClassicOption):
    """A repeatable option that also takes the numbers after it: ``--percent 10 20 30``.

    Click gives an option a fixed number of values; this one takes its first value as click does
    (so ``--percent half`` is click's bad-value error) and then every following argument that reads
    as a number, up to the next option or the first word that is not a number (a positional
    argument, or a stray one, which click then reports as an unexpected extra argument).
    """

    def add_to_parser(self, parser: Any, ctx: Any) -> None:
        super().add_to_parser(parser, ctx)
        for name in self.opts:
            option = parser._long_opt.get(name) or parser._short_opt.get(name)  # click has no public hook
            take = option.process

            def process(value: Any, state: Any, take: Any = take) -> None:
                take(value, state)
                while state.rargs and _is_number(state.rargs[0]):
                    take(state.rargs.pop(0), state)

            option.process = process

    def display_type_rich(self, ctx: Any) -> str | None:
        return f"{super().display_type_rich(ctx)}..."


class PruneCommand(ClassicCommand):
    """``heads prune``, whose ``--percent`` takes several numbers (:class:`ManyValuesOption`)."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)
        for param in params:
            if param.name == "percent" and type(param) is ClassicOption:
                param.__class__ = ManyValuesOption
        return params


def _probe(  # noqa: ANN202
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


def _is_corpus(probe) -> bool:  # noqa: ANN001
    """Whether ``probe`` is a corpus run's loss (--texts, streamed), not a probe holding its data."""
    from attnlab.analysis.fidelity import FidelityLoss
    from attnlab.analysis.lm_probe import NextTokenLoss

    return type(probe) in (NextTokenLoss, FidelityLoss)


def _corpus_sums(
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


def _held_note(loaded) -> str | None:  # noqa: ANN001
    held = loaded.held_heads
    if not held:
        return None
    return f"held at zero by train.mask_heads (off throughout, like `attnlab eval`): {', '.join(map(str, held))}"


def _json_head(loaded, probe) -> dict[str, Any]:  # noqa: ANN001
    """What every ``heads --json`` object starts with: the run, the metric, the held heads."""
    return {
        "run": loaded.source,
        "metric_name": probe.metric_name,
        "held_heads": [str(head) for head in loaded.held_heads],
    }


def _rows(rows: list[Any]) -> list[dict[str, Any]]:
    """Dataclass rows (one per head or per percentage) as JSON objects."""
    import dataclasses

    return [dataclasses.asdict(row) for row in rows]


@heads_app.command("ablate")
def ablate_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    split: Split = typer.Option(Split.valid, "--split", help=SPLIT_HELP),
    out: Path = typer.Option(None, "--out", help="Folder for the CSVs and heatmaps (default RUN/analysis)."),
    kinds: list[HeadKind] = typer.Option(None, "--kind", help=KIND_HELP),
    batch_size: int = typer.Option(None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help=BATCH_HELP),
    texts: Path = typer.Option(None, "--texts", help=TEXTS_HELP),
    pairs: Path = typer.Option(None, "--pairs", help=PAIRS_HELP),
    mean_over: Path = typer.Option(
        None,
        "--mean-over",
        help="Mean ablation: replace a head's output by its mean over this text file (one text per line) "
        "instead of zeroing it (xi_h = 0).",
    ),
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
    as_json: bool = json_option(),
) -> None:
    """The metric and loss with each head masked alone, and with all heads of a layer but one.

    With --mean-over FILE a head is mean-ablated: its output is its mean over FILE's texts.

    --texts is a corpus run: the file is streamed (any size), every mask is
    measured on each batch, --nproc spreads it over processes and --resume continues it
    (state: FOLDER/ablation.resume.json).
    """
    from tqdm import tqdm

    from attnlab.analysis.corpus import finish
    from attnlab.analysis.heads import ablate
    from attnlab.head_ids import head_ids

    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    kinds = [value_of(kind) for kind in kinds or ()]
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded, probe = _probe(
            run,
            split,
            batch_size,
            texts,
            pairs,
            placed(device, device_map, max_memory, offload_folder),
            dtype,
            revision,
            verify,
            True,
            nproc > 1 or resume or nnodes > 1,
        )
        folder = out or loaded.analysis
        means = None
        if mean_over is not None:
            from attnlab.analysis.patching import head_means

            means = head_means(loaded, mean_over)
        if _is_corpus(probe):
            from attnlab.analysis.corpus import corpus_identity
            from attnlab.analysis.corpus_sums import AblationSums

            objective = AblationSums(probe, kinds or None, means)
            state = folder / "ablation.resume.json"
            mean_file = corpus_identity(mean_over) if mean_over is not None else None
            sums = _corpus_sums(
                loaded,
                objective,
                texts,
                "ablate",
                batch_size=batch_size,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                dtype=dtype,
                revision=revision,
                kinds=kinds,
                mean_over=mean_file,
            )
            result = objective.ablation(sums)
            if not info.is_main:
                return
        else:
            state = None
            total = 2 * len(head_ids(loaded.model, kinds or None))
            with tqdm(total=total, desc="ablate", disable=not progress) as bar:
                result = ablate(probe, kinds or None, progress=lambda: bar.update(1), means=means)
        _report_ablation(loaded, probe, result, folder, means, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_ablation(loaded, probe, result, folder: Path, means, as_json: bool) -> None:  # noqa: ANN001
    """Write the ablation's CSVs and heatmaps, all in place together (a failed write leaves none),
    and print where they are."""
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.run.storage import atomic_directory

    columns = ("kind", "layer", "head", "metric", "loss", "delta")
    with atomic_directory(folder) as staging:
        write_rows(result.single, staging / "ablation.csv", columns)
        write_rows(result.keep_one, staging / "keep_one.csv", columns)
        kinds = list(dict.fromkeys(r.kind for r in result.single))
        for kind in kinds:
            head_matrix_plot(
                [r for r in result.single if r.kind == kind],
                "delta",
                staging / f"ablation_{kind}.png",
                diverging=True,
                title=f"change of {probe.metric_name} with one head {'mean-' if means else ''}ablated",
            )
    single, keep_one = folder / "ablation.csv", folder / "keep_one.csv"
    heatmaps = [folder / f"ablation_{kind}.png" for kind in kinds]
    if as_json:
        print_json(
            {
                **_json_head(loaded, probe),
                "baseline": {"metric": result.baseline.metric, "loss": result.baseline.loss},
                "ablation": "mean" if means else "zero",
                "single": _rows(result.single),
                "keep_one": _rows(result.keep_one),
                "files": {"ablation": str(single), "keep_one": str(keep_one), "heatmaps": list(map(str, heatmaps))},
            }
        )
        return
    baseline = "with the held heads off" if loaded.held_heads else "unmasked"
    typer.echo(
        f"{baseline}: metric {result.baseline.metric:.4f} ({probe.metric_name}), loss {result.baseline.loss:.4f}"
    )
    if note := _held_note(loaded):
        typer.echo(note)
    typer.echo(f"each head {'mean-ablated' if means else 'masked'} alone: {single}")
    typer.echo(f"only one head kept per layer: {keep_one}")
    for path in heatmaps:
        typer.echo(f"heatmap: {path}")


@heads_app.command("importance")
def importance_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    split: Split = typer.Option(Split.valid, "--split", help=SPLIT_HELP),
    normalize_per_layer: bool = typer.Option(
        False, "--normalize-per-layer", help="Divide each layer's scores by their l2 norm."
    ),
    out: Path = typer.Option(None, "--out", help="The CSV to write (default RUN/analysis/importance.csv)."),
    kinds: list[HeadKind] = typer.Option(None, "--kind", help=KIND_HELP),
    batch_size: int = typer.Option(None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help=BATCH_HELP),
    texts: Path = typer.Option(None, "--texts", help=TEXTS_HELP),
    pairs: Path = typer.Option(None, "--pairs", help=PAIRS_HELP),
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
    as_json: bool = json_option(),
) -> None:
    """I_h = E_x |dL/dxi_h| for every head, from one forward and backward pass per batch.

    --texts is a corpus run: the file is streamed (any size), --nproc spreads
    it over processes and --resume continues it (state: OUT with the suffix .resume.json).
    """
    from tqdm import tqdm

    from attnlab.analysis.corpus import finish
    from attnlab.analysis.heads import importance

    if out is not None:
        check_output_path(out, kind="file", flag="--out")
        check_output_path(out.with_suffix(".png"), kind="file", flag="--out (its heatmap)")
    kinds = [value_of(kind) for kind in kinds or ()]
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded, probe = _probe(
            run,
            split,
            batch_size,
            texts,
            pairs,
            placed(device, device_map, max_memory, offload_folder),
            dtype,
            revision,
            verify,
            True,
            nproc > 1 or resume or nnodes > 1,
        )
        path = out or loaded.analysis / "importance.csv"
        if _is_corpus(probe):
            from attnlab.analysis.corpus_sums import ImportanceSums

            objective = ImportanceSums(probe)
            state = path.with_suffix(".resume.json")
            sums = _corpus_sums(
                loaded,
                objective,
                texts,
                "importance",
                batch_size=batch_size,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                dtype=dtype,
                revision=revision,
            )
            rows = objective.rows(sums, normalize_per_layer=normalize_per_layer, kinds=kinds or None)
            if not info.is_main:
                return
        else:
            state = None
            with tqdm(desc="importance", unit="batch", disable=not progress) as bar:
                rows = importance(
                    probe, normalize_per_layer=normalize_per_layer, kinds=kinds or None, progress=lambda: bar.update(1)
                )
        _report_importance(loaded, probe, rows, path, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_importance(loaded, probe, rows, path: Path, as_json: bool) -> None:  # noqa: ANN001
    """Write the importances' CSV and heatmap, in place together (a failed write leaves neither),
    and print where they are and the top heads."""
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.run.storage import atomic_directory

    with atomic_directory(path.parent) as staging:
        write_rows(rows, staging / path.name, ("kind", "layer", "head", "importance"))
        head_matrix_plot(
            rows, "importance", staging / path.with_suffix(".png").name, title=f"head importance ({probe.metric_name})"
        )
    picture = path.with_suffix(".png")
    if as_json:
        print_json({**_json_head(loaded, probe), "importance": _rows(rows), "csv": str(path), "heatmap": str(picture)})
        return
    typer.echo(f"importance: {path}")
    typer.echo(f"heatmap: {picture}")
    for row in sorted(rows, key=lambda r: -r.importance)[:5]:
        typer.echo(f"  {row.kind}:{row.layer}:{row.head}  {row.importance:.4g}")
    if note := _held_note(loaded):
        typer.echo(f"{note} (importance 0)")


@heads_app.command("prune", cls=PruneCommand)
def prune_command(
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    percent: list[float] = typer.Option(
        ...,
        "--percent",
        min=0.0,
        max=100.0,
        help="Percentages of heads to prune: --percent 10 20 30 (or --percent 10 --percent 20).",
    ),
    recompute: bool = typer.Option(False, "--recompute", help="Recompute importances after each step."),
    keep_one_per_layer: bool = typer.Option(False, "--keep-one-per-layer", help="Never prune a layer's last head."),
    normalize_per_layer: bool = typer.Option(
        False,
        "--normalize-per-layer",
        help="Divide each layer's importances by their l2 norm before the global ranking (Michel et al. §4.2).",
    ),
    retrain_steps: int = typer.Option(
        0,
        "--retrain-steps",
        min=0,
        max=MAX_STEPS,
        help="After pruning at each percentage, fine-tune this many steps on the train split with the pruned "
        "heads held off, then measure (each percentage starts from the run's weights).",
    ),
    physical: bool = typer.Option(
        False, "--physical", help="Write a new run without the pruned heads (one --percent)."
    ),
    out: Path = typer.Option(None, "--out", help="Folder for curve.csv/curve.png, or the new run with --physical."),
    importance_split: Split = typer.Option(
        None, "--importance-split", help="The split the importances are computed on; default valid."
    ),
    split: Split = typer.Option(None, "--split", help="The split the pruning curve is measured on; default test."),
    kinds: list[HeadKind] = typer.Option(None, "--kind", help=KIND_HELP),
    batch_size: int = typer.Option(None, "--batch-size", min=1, max=MAX_BATCH_SIZE, help=BATCH_HELP),
    texts: Path = typer.Option(None, "--texts", help=TEXTS_HELP),
    pairs: Path = typer.Option(None, "--pairs", help=PAIRS_HELP),
    progress: bool = progress_option(),
    device: str = device_option(),
    dtype: str | None = dtype_option(),
    revision: str | None = revision_option(),
    verify: bool = verify_option(),
    as_json: bool = json_option(),
) -> None:
    """Mask the least important heads (ranked globally) and evaluate; or remove them for good.

    The importances come from --importance-split (default valid) and the curve is measured on
    --split (default test), so the ranking is not scored on the data it was fitted to.
    Heads held at zero by train.mask_heads stay off and are not counted in --percent; --physical
    removes them too (they contribute nothing).
    """
    percents = list(percent)
    from attnlab.analysis.heads import check_percents

    check_percents(percents, flag="--percent")
    if physical and out is None:
        raise UsageError("--physical: give --out NEW_RUN for the pruned run")
    if physical and retrain_steps:
        raise UsageError("--retrain-steps: not with --physical (fine-tune the pruned run with `attnlab train`)")
    if (texts is not None or pairs is not None) and (importance_split or split or retrain_steps):
        used = "--retrain-steps" if retrain_steps else "--importance-split and --split"
        raise UsageError(f"{used}: only for a run's task splits, not with --texts or --pairs")
    if out is not None:
        check_output_path(out, kind="run" if physical else "folder", flag="--out")
    kinds = [value_of(kind) for kind in kinds or ()]
    ranking_split = Split(importance_split or Split.valid).value
    curve_split = Split(split or Split.test).value
    loaded, probe = _probe(run, curve_split, batch_size, texts, pairs, {"device": device}, dtype, revision, verify)
    ranker = _ranking_probe(loaded, probe, ranking_split)
    if physical:
        _prune_physically(
            loaded,
            probe,
            percents,
            out,
            keep_one_per_layer,
            kinds or None,
            as_json=as_json,
            ranker=ranker,
            normalize_per_layer=normalize_per_layer,
        )
        return
    from tqdm import tqdm

    from attnlab.analysis.heads import pruning_curve
    from attnlab.analysis.reports import curve_plot, write_rows
    from attnlab.run.storage import atomic_directory

    retrain = None
    if retrain_steps:
        from attnlab.analysis.retrain import fine_tune

        def retrain(mask) -> None:  # noqa: ANN001
            fine_tune(loaded, mask, retrain_steps)

    folder = out or loaded.analysis
    with tqdm(total=len(percents), desc="prune", disable=not progress) as bar:
        rows = pruning_curve(
            probe,
            percents,
            recompute=recompute,
            keep_one_per_layer=keep_one_per_layer,
            normalize_per_layer=normalize_per_layer,
            ranking_probe=ranker,
            retrain=retrain,
            kinds=kinds or None,
            progress=lambda: bar.update(1),
        )
    with atomic_directory(folder) as staging:  # the curve's files in place together, or neither
        write_rows(rows, staging / "curve.csv", ("percent", "heads_pruned", "metric", "loss"))
        curve_plot(rows, staging / "curve.png", metric=probe.metric_name, title="pruning the least important heads")
    csv_path, png = folder / "curve.csv", folder / "curve.png"
    protocol = _protocol(probe, ranker, normalize_per_layer, retrain_steps)
    if as_json:
        print_json(
            {**_json_head(loaded, probe), **protocol, "curve": _rows(rows), "csv": str(csv_path), "plot": str(png)}
        )
        return
    typer.echo(_protocol_line(protocol))
    for row in rows:
        typer.echo(f"{row.percent:5.1f}%  {row.heads_pruned:3d} heads  metric {row.metric:.4f}  loss {row.loss:.4f}")
    if note := _held_note(loaded):
        typer.echo(f"{note}; not counted in --percent")
    typer.echo(f"curve: {csv_path}")
    typer.echo(f"plot: {png}")


def _ranking_probe(loaded, probe, split: str):  # noqa: ANN001, ANN202
    """The probe the importances come from: the run's task on ``split`` (the curve's own probe
    when it is on that split, or when the objective is --texts / --pairs)."""
    from attnlab.analysis.heads import TaskProbe

    if not isinstance(probe, TaskProbe) or probe.split == split:
        return probe
    return TaskProbe(loaded, split, batch_size=probe.batch_size, base_mask=probe.base_mask)


def _protocol(probe, ranker, normalize_per_layer: bool, retrain_steps: int) -> dict[str, Any]:  # noqa: ANN001
    """How the heads were ranked and the curve measured, for the output."""
    return {
        "importance_split": getattr(ranker, "split", None),
        "split": getattr(probe, "split", None),
        "normalize_per_layer": normalize_per_layer,
        "retrain_steps": retrain_steps,
    }


def _protocol_line(protocol: dict[str, Any]) -> str:
    """``importance on valid (normalised per layer), curve on test, 10 fine-tuning steps per step``."""
    if protocol["split"] is None:
        text = "importance and curve on the given texts"
    else:
        text = f"importance on {protocol['importance_split']}, curve on {protocol['split']}"
    if protocol["normalize_per_layer"]:
        text += "; importances normalised per layer (l2)"
    if protocol["retrain_steps"]:
        text += f"; {protocol['retrain_steps']} fine-tuning steps on train after pruning, at each percentage"
    return text


def _prune_physically(  # noqa: PLR0913
    loaded, probe, percents, out, keep_one_per_layer, kinds, *, as_json: bool, ranker=None, normalize_per_layer=False
) -> None:  # noqa: ANN001
    import torch

    from attnlab.analysis.heads import heads_to_remove
    from attnlab.analysis.pruning import median_seconds, prune_model, renumber_heads, write_pruned_run
    from attnlab.head_ids import head_ids, mask_without

    if len(percents) != 1:
        raise UsageError("--physical: give exactly one --percent")
    if out is None:
        raise UsageError("--physical: give --out NEW_RUN for the pruned run")
    model = loaded.model
    all_heads = head_ids(model, kinds)
    held, chosen = heads_to_remove(
        probe,
        percents[0],
        keep_one_per_layer=keep_one_per_layer,
        normalize_per_layer=normalize_per_layer,
        ranking_probe=ranker,
        kinds=kinds,
    )
    pruned = [*held, *chosen]
    smaller = prune_model(model, pruned)
    new_run = write_pruned_run(loaded, smaller, out, pruned=pruned)  # in place only once complete
    mask = loaded.held_mask(pruned)
    still_held = renumber_heads(loaded.held_heads, pruned)  # held heads of kinds left out by --kind
    smaller_mask = mask_without(smaller, still_held) if still_held else None
    batch = next(iter(probe.batches()))
    with torch.no_grad():
        difference = (probe.outputs(model, batch, mask) - probe.outputs(smaller, batch, smaller_mask)).abs().max()
    masked_time, pruned_time = median_seconds(
        lambda: probe.outputs(model, batch, mask), lambda: probe.outputs(smaller, batch, smaller_mask)
    )
    if as_json:
        print_json(
            {
                **_json_head(loaded, probe),
                **_protocol(probe, ranker or probe, normalize_per_layer, 0),
                "pruned": [str(head) for head in sorted(pruned)],
                "pruned_held": [str(head) for head in held],
                "still_held": [str(head) for head in still_held],
                "heads": len(all_heads),
                "parameters": {"before": model.num_parameters(), "after": smaller.num_parameters()},
                "max_difference": float(difference),
                "seconds": {"masked": masked_time, "pruned": pruned_time},
                "pruned_run": str(new_run.path),
            }
        )
        return
    typer.echo(_protocol_line(_protocol(probe, ranker or probe, normalize_per_layer, 0)))
    typer.echo(f"pruned {len(pruned)} of {len(all_heads)} heads: {', '.join(map(str, sorted(pruned)))}")
    if held:
        typer.echo(
            f"  of which held at zero by train.mask_heads (free to remove, not counted in --percent): "
            f"{', '.join(map(str, held))}"
        )
    if still_held:
        typer.echo(f"  still held in the pruned run (train.mask_heads): {', '.join(map(str, still_held))}")
    typer.echo(f"parameters: {model.num_parameters():,} -> {smaller.num_parameters():,}")
    typer.echo(f"largest output difference from the masked model: {float(difference):.2e}")
    typer.echo(
        f"inference on one batch of {len(batch)}: masked {masked_time * 1e3:.2f} ms, pruned {pruned_time * 1e3:.2f} ms "
        f"({masked_time / pruned_time:.2f}x)"
    )
    typer.echo(f"pruned run: {new_run.path}")


@heads_app.command("detect")
def detect_command(
    ctx: typer.Context,
    run: Path = typer.Argument(..., help=SOURCE_HELP),
    texts: Path = typer.Option(
        None,
        "--texts",
        help="A text file, one text per line (each read alone): previous-token, BOS and positional scores are "
        "measured on it (streamed, any size); duplicate-token and induction always on repeated random tokens.",
    ),
    out: Path = typer.Option(
        None, "--out", help="Folder for detect.csv and the heatmaps (default RUN/analysis/detect)."
    ),
    length: int = typer.Option(
        None,
        "--length",
        min=2,
        max=4096,
        help="Random tokens per sequence, before it repeats; default 50 (fewer where the context is shorter).",
    ),
    batch_size: int = typer.Option(
        8, "--batch-size", min=1, max=MAX_BATCH_SIZE, help="Random sequences, and --texts texts per batch."
    ),
    window: int = typer.Option(4, "--window", min=0, max=64, help="Largest relative offset of a positional head."),
    seed: int = typer.Option(0, "--seed", min=0, max=2**31 - 1, help="Seed of the random tokens."),
    top: int = typer.Option(3, "--top", min=1, max=100, help="Heads named per pattern."),
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
    as_json: bool = json_option(),
) -> None:
    """Score every head for the patterns papers name: previous-token, duplicate-token, induction,
    BOS (attention sink) and positional.

    A score is the head's mean attention on the pattern's targets (1: all of it). Induction is
    Olsson et al.'s: on random tokens repeated twice, attention from the second half to the token
    after the first occurrence. Positional: the best fixed relative offset other than -1.

    --texts is a corpus run: the file is streamed (any size), --nproc spreads it over processes
    and --resume continues it (state: FOLDER/detect.resume.json); the random sequences are
    measured on the first process.
    """
    from attnlab.analysis.corpus import corpus_identity, finish, run_corpus
    from attnlab.analysis.detectors import ON_TEXTS, DetectSums, repeated_random, score_heads
    from attnlab.pretrained.sources import open_model

    if out is not None:
        check_output_path(out, kind="folder", flag="--out")
    where = corpus_processes(ctx, nproc, resume, texts, device, Nodes(nnodes, node_rank, master_addr, master_port))
    if where is None:  # the processes launched from here did the work
        return
    info, device = where
    with process_group(info):
        loaded = open_model(
            run, dtype=dtype, revision=revision, verify=verify, **placed(device, device_map, max_memory, offload_folder)
        )
        folder = out or loaded.analysis / "detect"
        random = repeated_random(loaded, length=length, batch=batch_size, seed=seed)  # checked before any pass
        sums, state = None, None
        if texts is not None:
            state = folder / "detect.resume.json"
            identity = corpus_identity(
                texts,
                command="heads detect",
                run=str(loaded.source),
                held=[str(head) for head in loaded.held_heads],
                window=window,
                dtype=dtype,
                revision=revision,
            )
            sums = run_corpus(
                texts,
                DetectSums(loaded, ON_TEXTS, window=window),
                batch_size=batch_size,
                identity=identity,
                state=state,
                resume=resume,
                info=info,
                progress=progress,
                desc="detect",
            )
            if not info.is_main:
                return
        detection = score_heads(loaded, random, sums, window=window, texts=texts)
        _report_detection(loaded, detection, folder, top, as_json)
        finish(state)  # the results are written: the state of a corpus run goes


def _report_detection(loaded, detection, folder: Path, top: int, as_json: bool) -> None:  # noqa: ANN001
    """Write the scores' CSV and a heatmap per pattern, and name the top heads."""
    import math
    from dataclasses import asdict

    from attnlab.analysis.detectors import PATTERNS
    from attnlab.analysis.reports import head_matrix_plot, write_rows
    from attnlab.head_ids import HeadId
    from attnlab.run.storage import atomic_directory

    columns = ("kind", "layer", "head", *PATTERNS, "positional_offset")
    heatmaps = {}
    with atomic_directory(folder) as staging:  # the folder in place once complete (a failed write leaves none)
        write_rows(detection.rows, staging / "detect.csv", columns)
        for name, pattern in PATTERNS.items():
            scored = [row for row in detection.rows if not math.isnan(getattr(row, name))]
            if scored:
                picture = head_matrix_plot(
                    scored, name, staging / f"detect_{name}.png", title=f"{name}: {pattern.what}"
                )
                heatmaps[name] = folder / picture.name
    table = folder / "detect.csv"
    top_heads = {name: detection.top(name, top) for name in PATTERNS}
    if as_json:
        print_json(
            {
                "run": loaded.source,
                "measured_on": detection.measured_on,
                "notes": detection.notes,
                "heads": [  # a score not measured (NaN in the CSV) is null
                    {key: None if isinstance(v, float) and math.isnan(v) else v for key, v in asdict(row).items()}
                    for row in detection.rows
                ],
                "top": {name: [str(HeadId(r.kind, r.layer, r.head)) for r in rows] for name, rows in top_heads.items()},
                "files": {"csv": str(table), "heatmaps": {name: str(path) for name, path in heatmaps.items()}},
            }
        )
        return
    for name, rows in top_heads.items():
        if not rows:
            continue
        named = ", ".join(
            f"{HeadId(r.kind, r.layer, r.head)} {getattr(r, name):.2f}"
            + (f" (offset {r.positional_offset:+d})" if name == "positional" else "")
            for r in rows
        )
        typer.echo(f"{name} ({detection.measured_on[name]}): {named}")
    for note in detection.notes:
        typer.echo(f"note: {note}")
    typer.echo(f"scores: {table}")
    for path in heatmaps.values():
        typer.echo(f"heatmap: {path}")
