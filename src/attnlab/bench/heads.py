"""``heads``: importance scores of every head of the ``train`` model over 8 batches.

Systems: attnlab's one-pass method (one forward and one backward per batch, with a per-example
head mask xi of shape (B, layers, heads); only dL/dxi is asked for), one plain forward + backward
(parameter gradients) for scale, and a naive per-head ablation loop (one forward per head per batch).
"""

from __future__ import annotations

import torch

from attnlab.analysis.heads import importance
from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.evaluation.objectives import OBJECTIVES, example_losses
from attnlab.head_ids import head_ids, mask_without

__all__ = ["run_heads"]


class _RandomBatchesProbe:
    def __init__(self, model, batches) -> None:  # noqa: ANN001
        self.model, self._batches = model, batches

    def batches(self):  # noqa: ANN201
        return iter(self._batches)

    def example_losses(self, batch, head_mask):  # noqa: ANN001, ANN201
        return example_losses("encoder_decoder", self.model, batch, head_mask, 0)

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
            OBJECTIVES["encoder_decoder"](model, batch, None, 0, 0.0).total.backward()

    @torch.no_grad()
    def per_head_loop() -> None:
        for batch in batches:
            OBJECTIVES["encoder_decoder"](model, batch, None, 0, 0.0)
            for head in heads:
                OBJECTIVES["encoder_decoder"](model, batch, mask_without(model, [head]), 0, 0.0)

    result = BenchResult("heads")
    systems = {"attnlab one-pass importance": one_pass, "one forward+backward": forward_backward,
               "naive per-head ablation loop": per_head_loop}
    # The per-head loop runs the forward pass the two other systems already warmed up, on the
    # same model and batches; a warm-up run of its own would add a minute for nothing.
    warmup = {"naive per-head ablation loop": 0}
    for system, seconds in interleaved_median_times(systems, repeats=repeats, warmup=warmup).items():
        result.add(system, "seconds", seconds, "s")
    ours = result.value("attnlab one-pass importance", "seconds")
    result.ratios["importance_vs_forward_backward"] = ours / result.value("one forward+backward", "seconds")
    result.targets["importance_vs_forward_backward"] = ("<=", 1.3)
    result.ratios["per_head_loop_vs_importance"] = result.value("naive per-head ablation loop", "seconds") / ours
    result.targets["per_head_loop_vs_importance"] = (">=", 20.0)
    result.notes.append(f"{len(heads)} heads, {len(batches)} batches of {sizes.batch}")
    return result
