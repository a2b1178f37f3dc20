"""``mfu``: the ``train`` model's achieved FLOP/s over the fp32 matmul FLOP/s of this machine.

FLOPs of one training step (forward and backward) are counted by ``torch.utils.flop_counter``,
taught the CPU's fused attention kernel (it knows only the CUDA ones, so it counted attention as
0 FLOPs: 5% of the step); the peak is the median rate of a large fp32 matmul, timed in rounds
interleaved with the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.experiment import TrainConfig
from attnlab.training.trainer import make_optimizer

__all__ = ["run_mfu", "count_step_flops", "CPU_ATTENTION_FLOPS"]


def _cpu_flash_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(query, key, value)  # 2 B H T_q T_k (d_k + d_v), as for the CUDA kernels


def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    # Model FLOPs, as MFU counts them (Chowdhery et al., PaLM, App. B): the four products of the
    # backward, twice the forward's, without the kernel's recomputation of the scores that
    # ``sdpa_backward_flop_count`` adds. The same count as the explicit bmm path gets.
    return 2 * sdpa_flop_count(query, key, value)


CPU_ATTENTION_FLOPS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_forward,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward,
}
"""FLOP formulas for PyTorch's CPU SDPA kernel, which ``FlopCounterMode`` does not count by itself."""


def count_step_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of ``step``: matmuls and fused attention, forward and backward."""
    with FlopCounterMode(display=False, custom_mapping=CPU_ATTENTION_FLOPS) as counter:
        step()
    return counter.get_total_flops()


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

    flops = count_step_flops(step)
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
