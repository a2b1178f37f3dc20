"""``train`` and ``train-headmask``: training throughput in tokens/s with Adam and cross-entropy.

Tokens per step = batch x (source length + target length). Each system takes the same random
batch; one step is forward, cross-entropy, backward and an Adam update.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from attnlab.bench.harness import BenchResult, median_time
from attnlab.bench.models import FULL, QUICK, Sizes, TorchTransformerSeq2Seq, attnlab_model, hf_available, hf_bart, random_batch
from attnlab.experiment import TrainConfig
from attnlab.training.trainer import make_optimizer

__all__ = ["run_train", "run_train_headmask"]


def _step(forward: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer, targets: torch.Tensor) -> Callable[[], None]:
    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = forward()
        F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)).backward()
        optimizer.step()

    return step


def _throughput(model: nn.Module, forward: Callable[[], torch.Tensor], sizes: Sizes, targets: torch.Tensor, repeats: int) -> float:
    model.train()
    optimizer = make_optimizer(model.parameters(), TrainConfig(lr=1e-4))
    seconds = median_time(_step(forward, optimizer, targets), repeats=repeats, warmup=2)
    return sizes.batch * 2 * sizes.length / seconds


def run_train(quick: bool = False, repeats: int = 5) -> BenchResult:
    sizes = QUICK if quick else FULL
    batch = random_batch(sizes)
    result = BenchResult("train")
    torch.manual_seed(0)
    ours = attnlab_model(sizes)
    result.add("attnlab", "train_throughput", _throughput(ours, lambda: ours(batch.src, batch.tgt_in), sizes, batch.tgt_out, repeats), "tokens/s")
    theirs = TorchTransformerSeq2Seq(sizes)
    result.add("torch.nn.Transformer", "train_throughput",
               _throughput(theirs, lambda: theirs(batch.src, batch.tgt_in), sizes, batch.tgt_out, repeats), "tokens/s")
    result.ratios["attnlab_vs_torch"] = result.value("attnlab", "train_throughput") / result.value("torch.nn.Transformer", "train_throughput")
    result.targets["attnlab_vs_torch"] = (">=", 1.15)
    if hf_available():
        bart = hf_bart(sizes)
        forward = lambda: bart(input_ids=batch.src, decoder_input_ids=batch.tgt_in).logits  # noqa: E731
        result.add("hf BART (sdpa)", "train_throughput", _throughput(bart, forward, sizes, batch.tgt_out, repeats), "tokens/s")
        result.ratios["attnlab_vs_hf"] = result.value("attnlab", "train_throughput") / result.value("hf BART (sdpa)", "train_throughput")
        result.targets["attnlab_vs_hf"] = (">=", 1.15)
    else:
        result.notes.append("transformers is not installed (pip install 'attnlab[bench]'): Hugging Face skipped")
    result.notes.append(f"sizes: {sizes}")
    return result


def run_train_headmask(quick: bool = False, repeats: int = 5) -> BenchResult:
    """25% of the heads masked (a fixed random choice) against no mask, same model and batch."""
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
    result.add("attnlab unmasked", "train_throughput",
               _throughput(model, lambda: model(batch.src, batch.tgt_in), sizes, batch.tgt_out, repeats), "tokens/s")
    result.add("attnlab 25% heads masked", "train_throughput",
               _throughput(model, lambda: model(batch.src, batch.tgt_in, head_mask=mask), sizes, batch.tgt_out, repeats), "tokens/s")
    result.ratios["masked_vs_unmasked"] = (
        result.value("attnlab 25% heads masked", "train_throughput") / result.value("attnlab unmasked", "train_throughput")
    )
    result.targets["masked_vs_unmasked"] = (">=", 0.95)
    return result
