"""Physical head pruning: remove heads' rows of W_Q, W_K, W_V and columns of W^O.

With grouped-query attention (``model.kv_heads``) a query head's rows of W_Q and columns of W^O
go with it, and a key/value head's rows of W_K and W_V go only when every query head of its group
is gone; the new config records, per layer, which kept key/value head each kept query head reads
(``model.kv_groups``), since the groups are no longer equal.

A masked head still costs its projections and its attention; a pruned head is gone. The pruned
model computes the same function as the model with those heads masked (Michel §2.3: xi_h = 0), with
fewer parameters and less work. A layer may lose every head: its attention sub-layer then adds only
the bias of W^O, exactly as when all its heads are masked.

The remaining heads of a layer are renumbered 0..h-1 in their old order; the new config records
the head count of every layer (``model.heads_per_layer``) so that the run loads like any other,
and its ``train.mask_heads`` (the heads held at zero, xi_h = 0) follow the renumbering: a held head
that was pruned leaves the list, any other gets its new index (:func:`renumber_heads`). So the
pruned run evaluates like the original with its held heads and the pruned ones masked.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch

from attnlab.devices import cast_parameters
from attnlab.errors import UsageError
from attnlab.head_ids import HeadId
from attnlab.nn import TransformerModel, build_model_to_load
from attnlab.nn.head_subsets import head_subset_state, kept_kv_index
from attnlab.run.directory import RunDir
from attnlab.run.loaded import LoadedRun

__all__ = ["prune_model", "renumber_heads", "write_pruned_run", "median_seconds"]


def prune_model(model: TransformerModel, pruned: Iterable[HeadId]) -> TransformerModel:
    """A new model without the heads in ``pruned``; every other weight is copied."""
    pruned = set(pruned)
    config = model.config
    if pruned and config.qk_norm == "full":
        raise UsageError(
            "--physical: this model normalises queries and keys over all heads together (qk_norm 'full', "
            "OLMo 2): removing heads would change the kept heads' normalisation. Mask heads instead "
            "(heads prune without --physical)"
        )
    counts: dict[str, list[int]] = {}
    groups: dict[str, list[list[int]]] = {}
    keep: dict[tuple[str, int], list[int]] = {}
    for site in model.attention_sites():
        kept = [h for h in range(site.module.heads) if HeadId.of(site, h) not in pruned]
        keep[(site.kind, site.layer)] = kept
        counts.setdefault(site.kind, []).append(0)
        counts[site.kind][site.layer] = len(kept)
        groups.setdefault(site.kind, []).append(kept_kv_index(site.module, kept))
    grouped = config.key_value_heads != config.heads
    shared = [k for k in groups if k != "cross" and (grouped or k in (config.kv_groups or {}))]
    new_config = config.replace(
        heads_per_layer=counts,
        kv_heads=config.kv_heads if grouped else None,  # multi-head attention: one key/value head per kept head
        kv_groups={kind: groups[kind] for kind in shared} or None,  # grouped-query attention only
        d_k=config.head_dim_k,
        d_v=config.head_dim_v,
    )
    new_model = cast_parameters(build_model_to_load(new_config), next(model.parameters()).dtype)  # bf16 stays bf16
    names = {id(module): name for name, module in model.named_modules()}
    state = model.state_dict()
    for site in model.attention_sites():
        prefix = names[id(site.module)]
        for key in [k for k in state if k.startswith(prefix + ".")]:
            del state[key]
        for key, value in head_subset_state(site.module, keep[(site.kind, site.layer)]).items():
            state[f"{prefix}.{key}"] = value
    new_model.load_state_dict(state, strict=True)
    return new_model.to(next(model.parameters()).device).eval()


def renumber_heads(heads: Iterable[HeadId], pruned: Iterable[HeadId]) -> list[HeadId]:
    """Where ``heads`` are after :func:`prune_model` removed ``pruned``, in the order given.

    A pruned head is dropped; any other keeps its kind and layer and its index falls by the number
    of pruned heads before it in its layer (the remaining heads keep their old order).
    """
    pruned = set(pruned)
    return [
        HeadId(
            h.kind,
            h.layer,
            h.head - sum(1 for p in pruned if (p.kind, p.layer) == (h.kind, h.layer) and p.head < h.head),
        )
        for h in heads
        if h not in pruned
    ]


def write_pruned_run(
    loaded: LoadedRun, pruned_model: TransformerModel, out: Path, *, pruned: Sequence[HeadId]
) -> RunDir:
    """A new run directory holding the pruned model, loadable by every command, written whole or
    not at all (:meth:`attnlab.run.directory.RunDir.staged`).

    ``pruned`` are the heads of ``loaded.model`` that ``pruned_model`` lacks; the run's
    ``train.mask_heads`` is renumbered through them (:func:`renumber_heads`).

    Raises:
        UsageError: ``pruned`` does not say how ``pruned_model`` was made from ``loaded.model``
        (another number of heads left in some layer).
    """
    _check_pruned(loaded.model, pruned_model, pruned)
    held = renumber_heads(loaded.held_heads, pruned)
    config = loaded.experiment.to_dict()
    pruned_config = pruned_model.config
    config["model"].update(heads_per_layer=pruned_config.heads_per_layer, d_k=pruned_config.d_k, d_v=pruned_config.d_v)
    if pruned_config.kv_groups is not None:
        config["model"]["kv_groups"] = pruned_config.kv_groups
    config["train"]["mask_heads"] = [str(h) for h in held]
    with RunDir.staged(out) as run:  # in place only once complete, under its lock
        run.write_config(config)
        tokenizer = loaded.tokenizer_text()  # verified; written with its record in the new manifest
        if tokenizer is not None:
            run.write_tokenizer(tokenizer)
        run.save_weights(pruned_model)
    return run


def _check_pruned(model: TransformerModel, pruned_model: TransformerModel, pruned: Sequence[HeadId]) -> None:
    before = {(s.kind, s.layer): s.module.heads for s in model.attention_sites()}
    after = {(s.kind, s.layer): s.module.heads for s in pruned_model.attention_sites()}
    gone = set(pruned)
    for head in gone:
        if not 0 <= head.head < before.get((head.kind, head.layer), 0):
            raise UsageError(f"pruned head {head} is not a head of the original model")
    for site, heads in before.items():
        left = heads - sum(1 for h in gone if (h.kind, h.layer) == site)
        if after.get(site) != left:
            raise UsageError(
                f"the pruned model has {after.get(site)} heads in {site[0]} layer {site[1]}, "
                f"but pruning {sorted(map(str, gone))} from {heads} leaves {left}"
            )


@torch.no_grad()
def median_seconds(*forwards: Callable[[], object], repeats: int = 15, warmup: int = 2) -> list[float]:
    """Median wall time of each function, timed in alternation so that a busy machine slows all alike."""
    for forward in forwards:
        for _ in range(warmup):
            forward()
    times: list[list[float]] = [[] for _ in forwards]
    for _ in range(repeats):
        for index, forward in enumerate(forwards):
            start = time.perf_counter()
            forward()
            times[index].append(time.perf_counter() - start)
    return [statistics.median(t) for t in times]
