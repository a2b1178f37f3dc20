"""The linear maps of every layer, y = x W^T + b, and the GEMM kernels that compute them.

Every projection of the model is this affine map: W^Q, W^K, W^V and W^O of multi-head attention
(Vaswani §3.2.2), the two maps of the FFN (Vaswani §3.3, Eq. 2; Agarwal Def. 6.5), and the output
layer. They hold 60-75% of a training step's time, so which fp32 GEMM runs them matters more than
anything else the model does on a CPU.

Kernels, in the registry :data:`LINEAR_KERNELS`:

* ``aten``: ``torch.nn.functional.linear``. On a CPU it runs fp32 GEMMs through MKL, which keeps its
  AVX2 kernels on AMD processors even where they have AVX-512.
* ``onednn``: the same map through PyTorch's oneDNN fp32 matmul (``torch.ops.mkldnn._linear_pointwise``),
  which picks its kernels from the processor's features. Forward and both gradients run there. It is
  full fp32 (no reduced-precision accumulation). On the project's AVX-512 EPYC it ran the model's
  GEMMs at 440-500 GFLOP/s against MKL's 220 (benchmarks/README.md). A map with fewer than
  :data:`MIN_ONEDNN_ROWS` rows (one decoding step at batch 1), and every tensor that is not a
  float32 CPU tensor, take ``F.linear``: there oneDNN's fixed cost per call is larger than MKL's
  (18 against 12 us for one row), or oneDNN has no kernel (float64).

``auto`` (:func:`preferred_linear_kernel`) picks ``onednn`` where PyTorch reports AVX-512 and ships
oneDNN, and ``aten`` elsewhere: on the AVX2-only EPYC that measured the project's earlier
benchmarks, oneDNN's fp32 linear was no faster than MKL's.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LinearKernel",
    "LINEAR_KERNELS",
    "MIN_ONEDNN_ROWS",
    "aten_linear",
    "onednn_linear",
    "onednn_available",
    "preferred_linear_kernel",
    "check_linear_kernel",
    "linear_kernel",
]

LinearKernel = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""(x (..., d_in), weight (d_out, d_in), bias (d_out,) or None) -> (..., d_out)."""

MIN_ONEDNN_ROWS = 4
"""Fewer rows than this go to ``F.linear``: oneDNN's cost per call beats MKL's only from 4 rows
(24 against 33 us for 4 rows of 256 -> 768; 25 against 21 us for 2)."""


def aten_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b through ``torch.nn.functional.linear``."""
    return F.linear(x, weight, bias)


@cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN and its dense fp32 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ b) on oneDNN; ``x`` (..., d_in) and ``weight`` (d_out, d_in) may be strided views."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _weight_gradient(grad_rows: Tensor, x_rows: Tensor) -> Tensor:
    """dL/dW = G^T X, (d_out, d_in), from G (R, d_out) and X (R, d_in).

    oneDNN streams its second operand as the "weight" of a linear map, and runs this reduction over
    R fastest when that operand is the wider of the two (d_out = 1024, d_in = 256: 343 against 237
    GFLOP/s), so the product is formed as (X^T G)^T when d_out is the wider.
    """
    if grad_rows.shape[1] >= x_rows.shape[1]:
        return _onednn_matmul(x_rows.t(), grad_rows.t()).t().contiguous()  # (X^T G)^T: (d_out, d_in)
    return _onednn_matmul(grad_rows.t(), x_rows.t())  # G^T X: (d_out, d_in)


class _OneDNNLinear(torch.autograd.Function):
    """y = x W^T + b with dL/dx = G W, dL/dW = G^T x, dL/db = sum over rows of G, all on oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn_matmul(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:  # type: ignore[override]
        x, weight = ctx.saved_tensors
        d_out, d_in = weight.shape
        grad_rows = grad.reshape(-1, d_out)  # (R, d_out), R = all leading dims of x
        need_x, need_weight, need_bias = ctx.needs_input_grad
        grad_x = _onednn_matmul(grad_rows, weight.t()).view(x.shape) if need_x else None  # G W
        grad_weight = _weight_gradient(grad_rows, x.reshape(-1, d_in)) if need_weight else None
        grad_bias = grad_rows.sum(0) if need_bias and ctx.has_bias else None
        return grad_x, grad_weight, grad_bias


def onednn_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b on oneDNN for float32 CPU tensors of at least :data:`MIN_ONEDNN_ROWS` rows;
    ``F.linear`` for the rest (other devices and dtypes, single decoding rows)."""
    rows = x.numel() // max(x.shape[-1], 1)
    on_onednn = (
        x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
        and rows >= MIN_ONEDNN_ROWS and weight.numel() > 0
    )
    if not on_onednn:
        return F.linear(x, weight, bias)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _OneDNNLinear.apply(x, weight, bias)
    return _onednn_matmul(x, weight, bias)


LINEAR_KERNELS: dict[str, LinearKernel] = {
    "aten": aten_linear,
    "onednn": onednn_linear,
}
"""Registry of GEMM kernels for the model's linear maps; ``auto`` picks one by the processor."""


@cache
def preferred_linear_kernel() -> str:
    """``onednn`` where PyTorch runs AVX-512 code and ships oneDNN; ``aten`` elsewhere."""
    if onednn_available() and torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return "onednn"
    return "aten"


def check_linear_kernel(name: str) -> None:
    """Raise ValueError unless ``name`` is ``auto`` or a kernel this PyTorch build can run."""
    if name != "auto" and name not in LINEAR_KERNELS:
        raise ValueError(f"linear: unknown {name!r}; allowed: auto, {', '.join(LINEAR_KERNELS)}")
    if name == "onednn" and not onednn_available():
        raise ValueError("linear: 'onednn' needs a PyTorch build with oneDNN (torch.backends.mkldnn); use 'aten' or 'auto'")


def linear_kernel(name: str) -> LinearKernel:
    """The kernel called ``name`` in :data:`LINEAR_KERNELS`, or ``auto``'s choice for this machine."""
    check_linear_kernel(name)
    return LINEAR_KERNELS[preferred_linear_kernel() if name == "auto" else name]
