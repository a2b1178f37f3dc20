"""``train`` and ``train-headmask``: training throughput in tokens/s with Adam and cross-entropy.

Tokens per step = batch x (source length + target length). Each system takes the same random
batch; one step is forward, cross-entropy, backward and an Adam update.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import (
    FULL,
    QUICK,
    Sizes,
    TorchTransformerSeq2Seq,
    attnlab_model,
    hf_available,
    hf_bart,
    random_batch,
)
from attnlab.experiment import TrainConfig
from attnlab.kernels.linear import linear_setting
from attnlab.nn import EncoderDecoder, masking_heads
from attnlab.training.trainer import make_optimizer

__all__ = ["run_train", "run_train_headmask", "ATEN_SYSTEM"]

ATEN_SYSTEM = "attnlab (linear on aten)"


def _training_step(model: nn.Module, forward: Callable[[], torch.Tensor], targets: torch.Tensor) -> Callable[[], None]:
    """One step: forward, cross-entropy, backward and an Adam update of ``model``."""
    model.train()
    optimizer = make_optimizer(model.parameters(), TrainConfig(lr=1e-4))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = forward()
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()

    return step


def _add_throughputs(result: BenchResult, steps: dict[str, Callable[[], None]], sizes: Sizes, repeats: int) -> None:
    """Time the systems' steps in interleaved rounds; record tokens/s for each."""
    for system, seconds in interleaved_median_times(steps, repeats=repeats, warmup=2).items():
        result.add(system, "train_throughput", sizes.batch * 2 * sizes.length / seconds, "tokens/s")


def run_train(quick: bool = False, repeats: int = 15) -> BenchResult:
    sizes = QUICK if quick else FULL
    batch = random_batch(sizes)
    result = BenchResult("train")
    torch.manual_seed(0)
    ours = attnlab_model(sizes)
    theirs = TorchTransformerSeq2Seq(sizes)
    steps = {
        "attnlab": _training_step(ours, lambda: ours(batch.src, batch.tgt_in), batch.tgt_out),
        "torch.nn.Transformer": _training_step(theirs, lambda: theirs(batch.src, batch.tgt_in), batch.tgt_out),
    }
    # The same model on F.linear's GEMMs (MKL on a CPU), as the two baselines run theirs: how much
    # of attnlab's lead is the kernel of its linear maps. No target.
    with _linear_setting("aten"):
        on_aten = EncoderDecoder(ours.config)
    on_aten.load_state_dict(ours.state_dict())
    steps[ATEN_SYSTEM] = _training_step(on_aten, lambda: on_aten(batch.src, batch.tgt_in), batch.tgt_out)
    if hf_available():
        bart = hf_bart(sizes)
        forward = lambda: bart(input_ids=batch.src, decoder_input_ids=batch.tgt_in).logits  # noqa: E731
        steps["hf BART (sdpa)"] = _training_step(bart, forward, batch.tgt_out)
    else:
        result.notes.append("transformers is not installed (pip install 'attnlab[bench]'): Hugging Face skipped")
    _add_throughputs(result, steps, sizes, repeats)
    result.ratios["attnlab_vs_torch"] = result.value("attnlab", "train_throughput") / result.value(
        "torch.nn.Transformer", "train_throughput"
    )
    result.ratios["attnlab_aten_linear_vs_torch"] = result.value(ATEN_SYSTEM, "train_throughput") / result.value(
        "torch.nn.Transformer", "train_throughput"
    )
    result.targets["attnlab_vs_torch"] = (">=", 1.15)
    if "hf BART (sdpa)" in steps:
        result.ratios["attnlab_vs_hf"] = result.value("attnlab", "train_throughput") / result.value(
            "hf BART (sdpa)", "train_throughput"
        )
        result.targets["attnlab_vs_hf"] = (">=", 1.15)
    result.notes.append(f"sizes: {sizes}")
    result.notes.append(f"attnlab's linear maps: ATTNLAB_LINEAR={linear_setting()} (auto: measured per shape class)")
    return result


@contextmanager
def _linear_setting(name: str) -> Iterator[None]:
    """``ATTNLAB_LINEAR=name`` while the modules built inside read it."""
    before = os.environ.get("ATTNLAB_LINEAR")
    os.environ["ATTNLAB_LINEAR"] = name
    try:
        yield
    finally:
        if before is None:
            del os.environ["ATTNLAB_LINEAR"]
        else:
            os.environ["ATTNLAB_LINEAR"] = before


def run_train_headmask(quick: bool = False, repeats: int = 15) -> BenchResult:
    """25% of the heads masked (a fixed random choice) against no mask: two copies of one model
    (the same weights, each with its own optimizer), on the same batch."""
    sizes = QUICK if quick else FULL
    batch = random_batch(sizes)
    torch.manual_seed(0)
    model = attnlab_model(sizes)
    shapes = model.head_mask_shapes()
    generator = torch.Generator().manual_seed(0)
    mask = {}
    for kind, (layers, heads) in shapes.items():
        flat = torch.ones(layers * heads)
        flat[torch.randperm(layers * heads, generator=generator)[: layers * heads // 4]] = 0.0
        mask[kind] = flat.view(layers, heads)
    result = BenchResult("train-headmask")
    masked = attnlab_model(sizes)
    masked.load_state_dict(model.state_dict())  # same weights; its own optimizer and parameters
    steps = {
        "attnlab unmasked": _training_step(model, lambda: model(batch.src, batch.tgt_in), batch.tgt_out),
        "attnlab 25% heads masked": _training_step(masked, lambda: masked(batch.src, batch.tgt_in), batch.tgt_out),
    }
    with masking_heads(masked, mask):  # xi scales every z of the masked model while it trains
        _add_throughputs(result, steps, sizes, repeats)
    result.ratios["masked_vs_unmasked"] = result.value("attnlab 25% heads masked", "train_throughput") / result.value(
        "attnlab unmasked", "train_throughput"
    )
    result.targets["masked_vs_unmasked"] = (">=", 0.95)
    return result
