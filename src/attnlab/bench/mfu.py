"""``mfu``: the ``train`` model's achieved FLOP/s over the fp32 matmul FLOP/s of this machine.

FLOPs of one training step (forward and backward) are counted by ``torch.utils.flop_counter``;
the peak is the median rate of a large fp32 matmul, measured in the same run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnlab.bench.harness import BenchResult, median_time
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.experiment import TrainConfig
from attnlab.training.trainer import make_optimizer

__all__ = ["run_mfu", "matmul_flops_per_second"]


def matmul_flops_per_second(n: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / median_time(lambda: a @ b, repeats=repeats, warmup=2)


def run_mfu(quick: bool = False, repeats: int = 5) -> BenchResult:
    sizes = QUICK if quick else FULL
    batch = random_batch(sizes)
    torch.manual_seed(0)
    model = attnlab_model(sizes).train()
    optimizer = make_optimizer(model.parameters(), TrainConfig(lr=1e-4))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(batch.src, batch.tgt_in)
        F.cross_entropy(logits.reshape(-1, sizes.vocab), batch.tgt_out.reshape(-1)).backward()
        optimizer.step()

    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    achieved = flops / median_time(step, repeats=repeats, warmup=2)
    peak = matmul_flops_per_second(512 if quick else 2048, repeats=repeats)
    result = BenchResult("mfu")
    result.add("attnlab train step", "flops_per_step", flops, "FLOP")
    result.add("attnlab train step", "achieved", achieved / 1e9, "GFLOP/s")
    result.add("fp32 matmul", "peak", peak / 1e9, "GFLOP/s")
    result.ratios["mfu"] = achieved / peak
    result.targets["mfu"] = (">=", 0.6)
    return result
