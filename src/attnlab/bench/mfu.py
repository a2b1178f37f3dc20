"""``mfu``: the ``train`` model's achieved FLOP/s over the fp32 matmul FLOP/s of this machine.

FLOPs of one training step (forward and backward) are counted by ``torch.utils.flop_counter``;
the peak is the median rate of a large fp32 matmul, timed in rounds interleaved with the step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.experiment import TrainConfig
from attnlab.training.trainer import make_optimizer

__all__ = ["run_mfu"]


def run_mfu(quick: bool = False, repeats: int = 15) -> BenchResult:
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
    n = 512 if quick else 2048
    a, b = torch.randn(n, n), torch.randn(n, n)
    seconds = interleaved_median_times({"step": step, "matmul": lambda: a @ b}, repeats=repeats, warmup=2)
    achieved, peak = flops / seconds["step"], 2 * n**3 / seconds["matmul"]
    result = BenchResult("mfu")
    result.add("attnlab train step", "flops_per_step", flops, "FLOP")
    result.add("attnlab train step", "achieved", achieved / 1e9, "GFLOP/s")
    result.add("fp32 matmul", "peak", peak / 1e9, "GFLOP/s")
    result.ratios["mfu"] = achieved / peak
    result.targets["mfu"] = (">=", 0.6)
    return result
