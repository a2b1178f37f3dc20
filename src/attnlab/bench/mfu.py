"""``mfu``: the ``train`` model's achieved FLOP/s over the fp32 matmul FLOP/s of this machine.

FLOPs of one training step (forward and backward) are counted by ``torch.utils.flop_counter``,
taught the CPU kernels it counts as 0 FLOPs: the fused attention kernels (PyTorch's and attnlab's;
it knows only the CUDA ones; attention is 5% of the step's FLOPs) and oneDNN's linear op, which
runs the linear maps and their gradients where :mod:`attnlab.kernels.linear` picks it (95% of the
step's FLOPs). The peak is the rate of a large fp32 matmul through the fastest GEMM kernel attnlab
can run its linear maps on (:data:`attnlab.kernels.linear.LINEAR_KERNELS`: MKL through ``F.linear``,
and oneDNN where PyTorch has it), each timed in rounds interleaved with the step. A peak from MKL
alone would undercount a machine whose oneDNN GEMM runs much faster (AVX-512 on an AMD EPYC),
and MFU could then pass 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from attnlab.bench.harness import BenchResult, interleaved_median_times
from attnlab.bench.models import FULL, QUICK, attnlab_model, random_batch
from attnlab.experiment import TrainConfig
from attnlab.kernels import native
from attnlab.kernels.linear import available_linear_kernels, linear_kernel, linear_setting, onednn_available
from attnlab.training.trainer import make_optimizer

__all__ = ["run_mfu", "count_step_flops", "cpu_kernel_flops"]


def _fused_attention_forward(query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    return sdpa_flop_count(query, key, value)  # Q K^T and P V: 2 B H T_q T_k (d_k + d_v), as for the CUDA kernels


def _fused_attention_backward(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    # Model FLOPs, as MFU counts them (Chowdhery et al., PaLM, App. B): the four products of the
    # backward (dV, dP, dQ, dK), twice the forward's, without the flash kernel's recomputation of
    # the scores that ``sdpa_backward_flop_count`` adds. The same count as the explicit bmm path gets.
    return 2 * sdpa_flop_count(query, key, value)


def _onednn_linear(x_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:  # noqa: ANN001
    # X (..., d_in) W^T with W (d_out, d_in): 2 rows d_in d_out, as for aten's addmm. The backward's
    # two products (G W and G^T X) are calls of this op too, and counted by it.
    return 2 * math.prod(x_shape) * weight_shape[0]


def cpu_kernel_flops() -> dict:
    """FLOP formulas for the CPU kernels ``FlopCounterMode`` does not count by itself: PyTorch's CPU
    SDPA kernel, oneDNN's linear op, and attnlab's attention kernel where it is built."""
    formulas = {
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _fused_attention_forward,
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _fused_attention_backward,
    }
    if onednn_available():
        formulas[torch.ops.mkldnn._linear_pointwise] = _onednn_linear
    if native.available():
        formulas[torch.ops.attnlab.short_attention] = _fused_attention_forward
        formulas[torch.ops.attnlab.short_attention_backward] = _fused_attention_backward
    return formulas


def count_step_flops(step: Callable[[], None]) -> int:
    """FLOPs of one call of ``step``: matmuls (aten's or oneDNN's) and fused attention, forward and backward."""
    with FlopCounterMode(display=False, custom_mapping=cpu_kernel_flops()) as counter:
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
    a, w = torch.randn(n, n), torch.randn(n, n)
    matmuls = {
        f"fp32 matmul ({name})": _square_matmul(linear_kernel(name), a, w) for name in available_linear_kernels()
    }
    seconds = interleaved_median_times({"step": step, **matmuls}, repeats=repeats, warmup=2)
    achieved = flops / seconds["step"]
    rates = {system: 2 * n**3 / seconds[system] for system in matmuls}
    result = BenchResult("mfu")
    result.add("attnlab train step", "flops_per_step", flops, "FLOP")
    result.add("attnlab train step", "achieved", achieved / 1e9, "GFLOP/s")
    for system, rate in rates.items():
        result.add(system, "matmul_rate", rate / 1e9, "GFLOP/s")
    peak_system = max(rates, key=rates.__getitem__)
    result.add("fp32 matmul", "peak", rates[peak_system] / 1e9, "GFLOP/s")
    result.ratios["mfu"] = achieved / rates[peak_system]
    result.targets["mfu"] = (">=", 0.6)
    result.notes.append(
        f"peak: the fastest of {', '.join(rates)} on {n} x {n} x {n}; the model's linear maps use "
        f"ATTNLAB_LINEAR={linear_setting()}"
    )
    return result


def _square_matmul(kernel: Callable, a: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: kernel(a, w, None)  # a W^T, 2 n^3 FLOPs
