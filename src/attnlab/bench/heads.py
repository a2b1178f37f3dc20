"""``heads``: importance scores of every head of the ``train`` model over 8 batches.

Systems: attnlab's one-pass method (one forward and one backward per batch, with a per-example
head mask xi of shape (B, layers, heads); only dL/dxi is asked for), one plain forward + backward
(parameter gradients) for scale, and a naive per-head ablation loop (one forward per head per batch,
timed per head: see :func:`run_heads`).
"""

from __future__ import annotations

import torch

from attnlab.analysis.heads import importance
from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.evaluation.objectives import OBJECTIVES, example_losses
from attnlab.head_ids import head_ids, mask_without
from attnlab.nn import EncoderDecoderConfig

SEQ2SEQ = EncoderDecoderConfig.kind
"""The kind of the benchmarked model: its objective in :data:`~attnlab.evaluation.objectives.OBJECTIVES`."""

__all__ = ["run_heads", "equal_slices"]


def equal_slices(units: list, rounds: int) -> list[list]:
    """``rounds`` slices of equal length that together cover every unit at least once, in order.

    The last slice wraps around to the first units when ``rounds`` does not divide their number,
    so that every round times the same amount of work.
    """
    size = -(-len(units) // rounds)  # ceil
    return [[units[(r * size + i) % len(units)] for i in range(size)] for r in range(rounds)]


class _RandomBatchesProbe:
    def __init__(self, model, batches) -> None:  # noqa: ANN001
        self.model, self._batches = model, batches

    def batches(self):  # noqa: ANN201
        return iter(self._batches)

    def example_losses(self, batch, head_mask):  # noqa: ANN001, ANN201
        return example_losses(SEQ2SEQ, self.model, batch, head_mask, 0)

    def evaluate(self, head_mask):  # noqa: ANN001, ANN201
        raise NotImplementedError("not timed here")


def run_heads(quick: bool = False, repeats: int = 5) -> BenchResult:
    sizes = QUICK if quick else FULL
    batches = [random_batch(sizes, seed=seed) for seed in range(2 if quick else 8)]
    torch.manual_seed(0)
    model = attnlab_model(sizes).eval()
    probe = _RandomBatchesProbe(model, batches)
    heads = head_ids(model)

    def one_pass() -> None:
        importance(probe)

    def forward_backward() -> None:
        for batch in batches:
            model.zero_grad(set_to_none=True)
            OBJECTIVES[SEQ2SEQ](model, batch, None, 0, 0.0).total.backward()

    # The naive loop is one unablated forward per batch, then one forward per head per batch: a
    # row of identical units (the same forward with a different head zeroed). It is run once in
    # full, spread over the timed rounds: each round ablates the next slice of units and is timed
    # per unit, and the loop's time is the median unit time times the number of units. Timing the
    # whole loop in every round instead would spend ten minutes of `bench all` on one baseline.
    units = [None, *heads]  # None: the unablated reference pass
    slices = equal_slices(units, repeats)
    next_slices = iter(slices)

    @torch.no_grad()
    def per_head_loop_slice() -> int:
        ablated = next(next_slices)
        for head in ablated:
            head_mask = None if head is None else mask_without(model, [head])
            for batch in batches:
                OBJECTIVES[SEQ2SEQ](model, batch, head_mask, 0, 0.0)
        return len(ablated)

    result = BenchResult("heads")
    systems = {
        "attnlab one-pass importance": one_pass,
        "one forward+backward": forward_backward,
        "naive per-head ablation loop": per_head_loop_slice,
    }
    # The per-head loop runs the forward pass the two other systems already warmed up, on the
    # same model and batches; a warm-up run of its own would ablate heads for nothing.
    warmup = {"naive per-head ablation loop": 0}
    medians = interleaved_median_times(systems, repeats=repeats, warmup=warmup)
    medians["naive per-head ablation loop"] *= len(units)
    for system, seconds in medians.items():
        result.add(system, "seconds", seconds, "s")
    ours = result.value("attnlab one-pass importance", "seconds")
    result.ratios["importance_vs_forward_backward"] = ours / result.value("one forward+backward", "seconds")
    result.targets["importance_vs_forward_backward"] = ("<=", 1.3)
    result.ratios["per_head_loop_vs_importance"] = result.value("naive per-head ablation loop", "seconds") / ours
    result.targets["per_head_loop_vs_importance"] = (">=", 20.0)
    result.notes.append(f"{len(heads)} heads, {len(batches)} batches of {sizes.batch}")
    result.notes.append(
        f"per-head loop: {len(units)} forwards per batch (reference + one per head), run once over "
        f"{repeats} rounds of {len(slices[0])}; its time is the median per-unit time x {len(units)}"
    )
    return result
