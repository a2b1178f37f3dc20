"""Which heads matter: ablation, importance and pruning with head masks (Michel et al.).

Michel §2.3 masks head h with a variable xi_h in MHAtt(x, q) = sum_h xi_h Att_h(x, q). Setting
xi_h = 0 removes the head; keeping xi real-valued makes the loss differentiable in it, and the
head importance score is

    I_h = E_x | dL(x) / dxi_h |        at xi = 1,

computed here for every head at once: xi has one row per example, shape (B, layers, heads), so a
single forward and backward pass per batch gives every example's gradient (never a loop over heads).

Every analysis starts from the probe's *base mask* b, which is the run's held heads
(``train.mask_heads``: xi_h = 0 throughout training, so those heads never learned) unless a
probe is given another. The model is run with the mask xi * b: the baseline is b itself (what
``attnlab eval`` measures), a held head's importance is |dL/dxi_h| = b_h |dL/dm_h| = 0, masking a
held head alone changes nothing, and pruning counts only the heads that are not held (they are
off already; physically removing them is free).

Everything works through a :class:`HeadProbe`: a model, data, a differentiable per-example loss and
an evaluation under a head mask. :class:`TaskProbe` is the probe of a trained run on one split;
other objectives (embedding fidelity for a pretrained encoder, :mod:`attnlab.analysis.fidelity`;
the next-token loss of a pretrained language model, :mod:`attnlab.analysis.lm_probe`) are other probes. Analysis only
passes head masks in and reads results out; it never changes a layer.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from attnlab.analysis.head_scores import HeadScores
from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.evaluation import evaluate
from attnlab.evaluation.objectives import PREDICTIONS, example_losses
from attnlab.head_ids import HeadId, head_ids, head_site, heads_off, mask_without
from attnlab.kernels.linear import packed_weights
from attnlab.nn import HeadMask, TransformerModel, trace
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.batching import make_batches
from attnlab.tasks.codec import TextCodec

__all__ = [
    "Score",
    "HeadProbe",
    "TaskProbe",
    "scoring_pairs",
    "held_mask_of",
    "held_heads_of",
    "AblationRow",
    "Ablation",
    "ablate",
    "ablation_plan",
    "removal",
    "ablation_of",
    "ImportanceRow",
    "importance",
    "head_importance",
    "importance_point",
    "importance_zeros",
    "importance_sums",
    "importance_rows",
    "CurveRow",
    "pruning_order",
    "heads_to_prune",
    "pruning_curve",
    "live_heads",
    "heads_to_remove",
]


@dataclass(frozen=True)
class Score:
    """The probe's metric and the loss under one head mask. The metric is higher-is-better (an
    accuracy, a fidelity, a correlation) unless the probe's ``metric_name`` says otherwise (a
    language model's perplexity, :mod:`attnlab.analysis.lm_probe`)."""

    metric: float
    loss: float


class HeadProbe(Protocol):
    """What head analysis needs: a model, batches, a per-example loss, and an evaluation.

    ``outputs`` gives what the model computes on a batch (logits, embeddings), so that a physically
    pruned model can be compared with, and timed against, the masked one. ``metric_name`` says
    what ``Score.metric`` is, for people. ``evaluate``, ``example_losses`` and ``outputs`` use the
    head mask they are given as it is.

    A probe may also have ``base_mask`` (a head mask, or None for all ones): the mask every
    analysis starts from, i.e. the run's held heads (see :func:`held_mask_of`).
    """

    model: TransformerModel
    metric_name: str

    def batches(self) -> Iterable[Any]: ...

    def example_losses(self, batch: Any, head_mask: HeadMask | None) -> Tensor:
        """(B,) differentiable losses of the batch's examples."""
        ...

    def evaluate(self, head_mask: HeadMask | None) -> Score: ...

    def outputs(self, model: TransformerModel, batch: Any, head_mask: HeadMask | None) -> Tensor: ...


class TaskProbe:
    """A trained run on one split of its task; the metric is the task's ``accuracy``.

    ``base_mask`` is where every analysis starts; by default the run's held heads
    (``loaded.held_mask()``, ``train.mask_heads``), so that the baseline equals ``attnlab eval``.
    Pass an all-ones mask (:func:`attnlab.nn.full_head_mask`) to analyse with the held heads on.
    """

    def __init__(
        self, loaded: LoadedRun, split: str = "valid", *, batch_size: int = 128, base_mask: HeadMask | None = None
    ) -> None:
        self.loaded, self.split, self.batch_size = loaded, split, batch_size
        self.model = loaded.model.eval()
        self.kind = loaded.experiment.model_kind
        self.base_mask = loaded.held_mask() if base_mask is None else base_mask
        train = loaded.experiment.train
        self.max_length = train.max_length or self.model.config.max_len
        self.truncate = train.truncate
        self.examples = loaded.task.split(split)
        if not self.examples:
            raise UsageError(f"split {split!r} of this run's task is empty")
        self.metric_name = f"{split} accuracy"

    def batches(self) -> Iterator[Any]:
        """The split's batches, on the model's device."""
        task, device = self.loaded.task, model_device(self.model)
        batches = make_batches(
            self.examples,
            self.batch_size,
            pad_id=task.pad_id,
            bos_id=task.bos_id,
            eos_id=task.eos_id,
            shuffle=False,
            max_length=self.max_length,
            truncate=self.truncate,
        )
        return (batch.to(device) for batch in batches)

    def example_losses(self, batch: Any, head_mask: HeadMask | None) -> Tensor:
        return example_losses(self.kind, self.model, batch, head_mask, self.loaded.task.pad_id)

    def evaluate(self, head_mask: HeadMask | None) -> Score:
        result = evaluate(
            self.model,
            self.loaded.task,
            self.split,
            kind=self.kind,
            batch_size=self.batch_size,
            max_length=self.max_length,
            truncate=self.truncate,
            tokenizer=self.loaded.tokenizer,
            head_mask=head_mask,
        )
        return Score(float(result["accuracy"]), float(result["loss"]))

    def outputs(self, model: TransformerModel, batch: Any, head_mask: HeadMask | None) -> Tensor:
        """The logits of ``model`` on ``batch``."""
        return PREDICTIONS[self.kind](model, batch, head_mask, self.loaded.task.pad_id).logits


def scoring_pairs(loaded: LoadedRun, path: str | os.PathLike[str]) -> LoadedRun:
    """``loaded`` whose task scores the ``source<TAB>target`` pairs of ``path`` in every split: a
    pretrained encoder-decoder's (:class:`attnlab.tasks.pretrained_seq2seq.PretrainedSeq2SeqTask`),
    for :class:`TaskProbe`.

    Raises:
        UsageError: a run whose task has its own data (a trained run scores its splits).
    """
    if not hasattr(loaded.task, "scoring"):
        raise UsageError(
            f"--texts: {loaded.name} is a trained encoder-decoder that scores its own task's splits (--split); "
            "source<TAB>target pairs are for a pretrained encoder-decoder"
        )
    task = loaded.task.scoring(path)
    return dataclasses.replace(loaded, task=task, codec=TextCodec(task, loaded.tokenizer))


def held_mask_of(probe: HeadProbe) -> HeadMask | None:
    """The mask every analysis of ``probe`` starts from: its ``base_mask`` (None: all heads on)."""
    return getattr(probe, "base_mask", None)


def held_heads_of(probe: HeadProbe) -> list[HeadId]:
    """The heads the probe's base mask holds at 0 (a run's ``train.mask_heads``)."""
    return heads_off(probe.model, held_mask_of(probe))


# ---- ablation ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AblationRow:
    """The metric and loss with one change of the mask; ``delta`` = metric - unmasked metric."""

    kind: str
    layer: int
    head: int
    metric: float
    loss: float
    delta: float


@dataclass(frozen=True)
class Ablation:
    """``single``: each head masked alone. ``keep_one``: all heads of a layer masked but ``head``."""

    baseline: Score
    single: list[AblationRow]
    keep_one: list[AblationRow]

    def deltas(self, experiment: str = "single") -> HeadScores:
        """Each head's ``delta`` (metric - unmasked metric) as (layers, heads) tensors per kind:
        ``single`` (the head masked alone) or ``keep_one`` (its layer's other heads masked)."""
        if experiment not in ("single", "keep_one"):
            raise UsageError(f"experiment: unknown {experiment!r}; allowed: single, keep_one")
        return HeadScores.of_rows("delta", getattr(self, experiment), "delta")


def ablate(
    probe: HeadProbe,
    kinds: Sequence[str] | None = None,
    *,
    progress: Any = None,
    means: Mapping[str, Tensor] | None = None,
) -> Ablation:
    """Mask each head alone, then keep only one head per layer (Michel §3's two experiments).

    Every mask is the base mask (the run's held heads) with more heads off; the baseline is the
    base mask itself. A held head masked alone is the baseline again (delta 0, not re-evaluated).

    With ``means`` (``z`` site name -> (H, d_v), :func:`attnlab.analysis.patching.head_means`) a
    head is mean-ablated instead: its output is replaced by its mean over a dataset rather than
    multiplied by xi_h = 0 (zero ablation).
    """
    tick = progress or (lambda: None)
    base = held_mask_of(probe)
    plan = ablation_plan(probe, kinds)
    with packed_weights():  # one weight read by every evaluation: oneDNN's packed copies reused
        baseline = probe.evaluate(base)
        scores = []
        for _, off in plan:
            if off:
                mask, edit = removal(probe, off, means)
                with edit:
                    scores.append(probe.evaluate(mask))
            else:
                scores.append(baseline)
            tick()
    return ablation_of(plan, baseline, scores)


def ablation_plan(probe: HeadProbe, kinds: Sequence[str] | None = None) -> list[tuple[HeadId, list[HeadId]]]:
    """What :func:`ablate` measures, in order: (head, the heads switched off) for each head alone,
    then for all heads of each head's layer but that one. Held heads are left out of the lists
    (they are off already): an empty list is the baseline."""
    heads = head_ids(probe.model, kinds)
    held = set(held_heads_of(probe))
    single = [(head, [head]) for head in heads]
    keep_one = [
        (head, [other for other in heads if (other.kind, other.layer) == (head.kind, head.layer) and other != head])
        for head in heads
    ]
    return [(head, [h for h in off if h not in held]) for head, off in single + keep_one]


def removal(
    probe: HeadProbe, off: Sequence[HeadId], means: Mapping[str, Tensor] | None = None
) -> tuple[HeadMask | None, AbstractContextManager[Any]]:
    """The mask and the edit that remove the heads ``off`` on top of the probe's base mask: zero
    ablation (xi_h = 0 in the mask, no edit) or, with ``means``, mean ablation (the base mask, and
    a trace that gives each head of ``off`` its mean output at its ``z`` site)."""
    base = held_mask_of(probe)
    if means is None:
        return mask_without(probe.model, off, base=base), nullcontext()
    for head in off:
        site = head_site(probe.model, head).name
        if site not in means:
            raise UsageError(f"--mean-over: no mean output for {site} (head {head})")
    return base, _mean_outputs(probe.model, off, means)


@contextmanager
def _mean_outputs(model: TransformerModel, off: Sequence[HeadId], means: Mapping[str, Tensor]) -> Iterator[None]:
    with trace(model) as t:
        for head in off:
            t.replace(
                head_site(model, head).name, means[head_site(model, head).name][head.head][None, :], heads=[head.head]
            )
        yield


def ablation_of(plan: Sequence[tuple[HeadId, list[HeadId]]], baseline: Score, scores: Sequence[Score]) -> Ablation:
    """The :class:`Ablation` of the scores measured for ``plan`` (:func:`ablation_plan`)."""
    rows = [
        AblationRow(head.kind, head.layer, head.head, score.metric, score.loss, score.metric - baseline.metric)
        for (head, _), score in zip(plan, scores, strict=True)
    ]
    half = len(rows) // 2
    return Ablation(baseline, rows[:half], rows[half:])


# ---- importance ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportanceRow:
    kind: str
    layer: int
    head: int
    importance: float


def importance(
    probe: HeadProbe,
    *,
    normalize_per_layer: bool = False,
    base_mask: HeadMask | None = None,
    kinds: Sequence[str] | None = None,
    progress: Any = None,
) -> list[ImportanceRow]:
    """I_h = E_x |dL(x)/dxi_h| at xi = 1 for the mask xi * b, one row per head (:func:`head_importance`).

    With ``normalize_per_layer`` each layer's scores are divided by their l2 norm (Michel et al.).
    ``base_mask`` and ``progress``: as :func:`head_importance`.
    """
    scores = head_importance(probe, base_mask=base_mask, progress=progress)  # means: one "example" each
    return importance_rows(probe.model, scores, 1, normalize_per_layer=normalize_per_layer, kinds=kinds)


def head_importance(probe: HeadProbe, *, base_mask: HeadMask | None = None, progress: Any = None) -> dict[str, Tensor]:
    """I_h = E_x |dL(x)/dxi_h| at xi = 1 for the mask xi * b, one forward+backward per batch.

    b is ``base_mask``, by default the probe's (the run's held heads). A head with b_h = 0 (held,
    or already pruned) scores dL/dxi_h = b_h dL/dm_h = 0; the others get Michel's score at the
    point b. Only dL/dxi is computed: the parameters are taken out of the graph for the pass (no
    weight gradient is formed, and the forward keeps only what the backward to xi needs).
    ``progress``, if given, is called once per batch.

    Returns:
        head-mask kind -> (layers, heads) float64 scores on the CPU (the mean over the examples).
    """
    tick = progress or (lambda: None)
    point = importance_point(probe, base_mask)
    totals = importance_zeros(probe.model)
    examples = 0
    for batch in probe.batches():
        for kind, total in importance_sums(probe, batch, point).items():
            totals[kind] += total
        examples += _batch_rows(batch)
        tick()
    return {kind: total / max(1, examples) for kind, total in totals.items()}


def importance_point(probe: HeadProbe, base_mask: HeadMask | None = None) -> HeadMask:
    """The mask b importance is taken at: ``base_mask``, by default the probe's, every kind filled in."""
    return mask_without(probe.model, (), base=held_mask_of(probe) if base_mask is None else base_mask)


def importance_zeros(model: TransformerModel) -> dict[str, Tensor]:
    """Zero float64 sums of |dL/dxi|, one (layers, heads) tensor per attention kind."""
    return {kind: torch.zeros(shape, dtype=torch.float64) for kind, shape in model.head_mask_shapes().items()}


def importance_sums(probe: HeadProbe, batch: Any, point: HeadMask) -> dict[str, Tensor]:
    """sum_x |dL(x)/dxi_h| over the batch's examples x at the mask ``point``, per attention kind:
    float64 (layers, heads) tensors on the CPU, from one forward and one backward pass.

    xi has one row per example, (B, layers, heads), so one backward pass gives every example's
    gradient for every head.
    """
    rows = _batch_rows(batch)
    shapes = probe.model.head_mask_shapes()
    xi = {
        kind: torch.ones(rows, *shape, device=point[kind].device, requires_grad=True) for kind, shape in shapes.items()
    }
    with _frozen(probe.model):  # only dL/dxi: no weight gradient formed, less kept by the forward
        losses = probe.example_losses(batch, {kind: xi[kind] * point[kind] for kind in shapes})
        grads = torch.autograd.grad(losses.sum(), list(xi.values()))
    return {kind: grad.detach().abs().double().sum(0).cpu() for kind, grad in zip(xi, grads)}


def importance_rows(
    model: TransformerModel,
    sums: Mapping[str, Tensor],
    examples: float,
    *,
    normalize_per_layer: bool = False,
    kinds: Sequence[str] | None = None,
) -> list[ImportanceRow]:
    """The rows of :func:`importance` from the sums of |dL/dxi| over ``examples`` examples."""
    scores = {kind: sums[kind] / max(1, examples) for kind in model.head_mask_shapes()}
    if normalize_per_layer:
        scores = {kind: s / s.norm(dim=-1, keepdim=True).clamp_min(1e-20) for kind, s in scores.items()}
    return [
        ImportanceRow(h.kind, h.layer, h.head, float(scores[h.kind][h.layer, h.head])) for h in head_ids(model, kinds)
    ]


@contextmanager
def _frozen(model: torch.nn.Module) -> Iterator[None]:
    """The model's parameters with ``requires_grad`` off inside the block, as they were after it."""
    wanted = [p for p in model.parameters() if p.requires_grad]
    for parameter in wanted:
        parameter.requires_grad_(False)
    try:
        yield
    finally:
        for parameter in wanted:
            parameter.requires_grad_(True)


def _batch_rows(batch: Any) -> int:
    return len(batch) if hasattr(batch, "__len__") else int(batch.shape[0])


# ---- pruning -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CurveRow:
    percent: float
    heads_pruned: int
    metric: float
    loss: float


def pruning_order(scores: Sequence[ImportanceRow]) -> list[HeadId]:
    """Heads from least to most important, ranked globally across layers and kinds."""
    return [
        HeadId(r.kind, r.layer, r.head) for r in sorted(scores, key=lambda r: (r.importance, r.kind, r.layer, r.head))
    ]


def heads_to_prune(
    order: Sequence[HeadId],
    count: int,
    *,
    already: Iterable[HeadId] = (),
    keep_one_per_layer: bool = False,
    all_heads: Sequence[HeadId] = (),
) -> list[HeadId]:
    """Extend ``already`` with heads from ``order`` until ``count`` are pruned.

    With ``keep_one_per_layer`` the last head of a layer is never taken (so fewer than ``count``
    may be returned when nothing else is left).
    """
    pruned = list(already)
    alive: dict[tuple[str, int], int] = {}
    for head in all_heads or order:
        alive[(head.kind, head.layer)] = alive.get((head.kind, head.layer), 0) + 1
    for head in pruned:
        alive[(head.kind, head.layer)] -= 1
    for head in order:
        if len(pruned) >= count:
            break
        if head in pruned or (keep_one_per_layer and alive[(head.kind, head.layer)] <= 1):
            continue
        pruned.append(head)
        alive[(head.kind, head.layer)] -= 1
    return pruned


def pruning_curve(
    probe: HeadProbe,
    percents: Sequence[float],
    *,
    recompute: bool = False,
    keep_one_per_layer: bool = False,
    normalize_per_layer: bool = False,
    ranking_probe: HeadProbe | None = None,
    retrain: Callable[[HeadMask], Any] | None = None,
    kinds: Sequence[str] | None = None,
    progress: Any = None,
) -> list[CurveRow]:
    """Mask the least important heads, ``percents`` of all heads at a time, and evaluate each step.

    Held heads (off in the probe's base mask, i.e. ``train.mask_heads``) stay off in every step
    and are not counted: ``percent`` is of the other heads, ``heads_pruned`` counts only those,
    and 0% is the baseline (what ``attnlab eval`` measures). With ``recompute`` the importances of
    the remaining heads are recomputed (at the current mask) before each step; otherwise one
    ranking serves every step.

    Michel et al. (2019) §4.2's protocol is available in full:

    * ``normalize_per_layer``: the importances are divided by their l2 norm within each layer,
      I_h / ||I_layer(h)||_2, before the global ranking (as :func:`importance`);
    * ``ranking_probe``: the importances come from this probe (another split of the same model,
      e.g. valid) while the curve is measured on ``probe`` (e.g. test), so the ranking is not
      fitted to the data it is scored on; default: ``probe`` itself;
    * ``retrain``: called with each step's mask (pruned and held heads at 0) before that step is
      measured, to fine-tune ``probe.model`` in place with those heads off
      (:func:`attnlab.analysis.retrain.fine_tune`); every step starts again from the weights
      given (the 0% step is fine-tuned too, so every point had the same training), and they are
      put back at the end.
    """
    check_percents(percents)
    ranker = probe if ranking_probe is None else ranking_probe
    if ranker.model is not probe.model:
        raise ValueError("ranking_probe must probe the same model as probe")
    base = held_mask_of(probe)
    live = live_heads(probe, kinds)
    alive = set(live)
    order = [
        h for h in pruning_order(importance(ranker, normalize_per_layer=normalize_per_layer, kinds=kinds)) if h in alive
    ]
    pruned: list[HeadId] = []
    rows = []
    tick = progress or (lambda: None)
    original = _snapshot(probe.model) if retrain is not None else None
    try:
        for percent in sorted(percents):
            count = round(percent / 100 * len(live))
            if recompute and pruned:
                at = mask_without(probe.model, pruned, base=base)
                remaining = [
                    r
                    for r in importance(ranker, normalize_per_layer=normalize_per_layer, base_mask=at, kinds=kinds)
                    if HeadId(r.kind, r.layer, r.head) in alive and HeadId(r.kind, r.layer, r.head) not in pruned
                ]
                order = pruned + pruning_order(remaining)
            pruned = heads_to_prune(order, count, already=pruned, keep_one_per_layer=keep_one_per_layer, all_heads=live)
            mask = mask_without(probe.model, pruned, base=base)
            if retrain is not None:
                retrain(mask)
            score = probe.evaluate(mask)
            if original is not None:
                probe.model.load_state_dict(original)
            rows.append(CurveRow(percent, len(pruned), score.metric, score.loss))
            tick()
    finally:
        if original is not None:
            probe.model.load_state_dict(original)
            probe.model.eval()
    return rows


def _snapshot(model: TransformerModel) -> dict[str, Tensor]:
    """A copy of the model's weights, to put back after fine-tuning."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def live_heads(probe: HeadProbe, kinds: Sequence[str] | None = None) -> list[HeadId]:
    """The heads (of ``kinds``) that pruning may take: every head the base mask does not hold at 0."""
    held = set(held_heads_of(probe))
    return [h for h in head_ids(probe.model, kinds) if h not in held]


def heads_to_remove(
    probe: HeadProbe,
    percent: float,
    *,
    keep_one_per_layer: bool = False,
    normalize_per_layer: bool = False,
    ranking_probe: HeadProbe | None = None,
    kinds: Sequence[str] | None = None,
) -> tuple[list[HeadId], list[HeadId]]:
    """What physical pruning at ``percent`` removes: (held heads, least important other heads).

    The held heads (of ``kinds``) contribute nothing, so removing them is free and always done;
    ``percent`` is of the other heads, ranked as in :func:`pruning_curve` (one ranking, from
    ``ranking_probe`` when given, normalised per layer with ``normalize_per_layer``), so the
    pruned model computes what the curve's masked model at ``percent`` computes.
    """
    check_percents([percent])
    ranker = probe if ranking_probe is None else ranking_probe
    held = set(held_heads_of(probe))
    live = [h for h in head_ids(probe.model, kinds) if h not in held]
    scores = importance(ranker, normalize_per_layer=normalize_per_layer, kinds=kinds)
    order = [h for h in pruning_order(scores) if h not in held]
    chosen = heads_to_prune(
        order, round(percent / 100 * len(live)), keep_one_per_layer=keep_one_per_layer, all_heads=live
    )
    return [h for h in head_ids(probe.model, kinds) if h in held], chosen


def check_percents(percents: Sequence[float], *, flag: str = "percent") -> None:
    """Each percentage of heads to prune lies in [0, 100]; errors name ``flag``."""
    if not percents:
        raise UsageError(f"{flag}: give at least one percentage")
    for percent in percents:
        if not 0 <= percent <= 100:
            raise UsageError(f"{flag}: {percent:g} is outside [0, 100]")
