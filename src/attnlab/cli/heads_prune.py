"""``attnlab heads prune``: Michel et al.'s pruning curve (heads masked by importance), and pruning
heads physically out of a copy of the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from attnlab.cli.app import ClassicCommand, ClassicOption
from attnlab.cli.choices import HeadKind, Split, value_of
from attnlab.cli.heads_common import (
    BATCH_HELP,
    KIND_HELP,
    PAIRS_HELP,
    TEXTS_HELP,
    command_probe,
    heads_app,
    held_note,
    json_head,
    json_rows,
)
from attnlab.cli.options import (
    SOURCE_HELP,
    device_option,
    dtype_option,
    json_option,
    print_json,
    progress_option,
    revision_option,
    verify_option,
)
from attnlab.errors import UsageError
from attnlab.limits import MAX_BATCH_SIZE, MAX_STEPS
from attnlab.run.output_paths import check_output_path


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
    loaded, probe = command_probe(
        run, curve_split, batch_size, texts, pairs, {"device": device}, dtype, revision, verify
    )
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
            {**json_head(loaded, probe), **protocol, "curve": json_rows(rows), "csv": str(csv_path), "plot": str(png)}
        )
        return
    typer.echo(_protocol_line(protocol))
    for row in rows:
        typer.echo(f"{row.percent:5.1f}%  {row.heads_pruned:3d} heads  metric {row.metric:.4f}  loss {row.loss:.4f}")
    if note := held_note(loaded):
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
                **json_head(loaded, probe),
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
