"""attnlab's CPU-speed machinery, behind the few calls the model makes.

The model (:mod:`attnlab.nn`) computes the papers' formulas; this package only makes them fast on
a CPU. Every call here computes the same function as the plain PyTorch it stands in for, and where
attnlab's C++ kernels cannot be built (:mod:`.native`, built by :mod:`.native_build`) each takes
PyTorch's (or NumPy's) path, with the same results. The interface:

* ``linear_kernel()``: the GEMM kernel ``(x, W, b) -> x W^T + b`` one module runs its linear maps
  with (:mod:`.linear`), as the runtime setting ``ATTNLAB_LINEAR`` says: ``aten`` (``F.linear``),
  ``onednn`` (oneDNN's fp32 matmul, forward and gradients), or ``auto`` (the default), the faster
  of them measured for each shape class.
* ``dropout(x, p, training)`` and the module ``Dropout(p)`` (:mod:`.dropout_masks`): ``F.dropout`` off the
  CPU; on a CPU, masks from PCG64 words drawn on all cores, faster than PyTorch's serial generator.
* ``short_attention_applies(q, k, v, mask, dropout_p)`` and ``short_attention(q, k, v, causal=,
  scale=)``: soft attention of short heads by attnlab's C++ kernel, forward and backward
  (:mod:`.attention`, :mod:`.native`).
* ``fused_swiglu_applies(hidden)`` and ``swiglu(hidden)``: SwiGLU's SiLU(gate) * up in one pass,
  and ``fused_rotary_applies(x, cos)`` and ``rotary(x, cos, sin)``: RoPE in one pass, both without
  gradients (:mod:`.gated`, :mod:`.native`).
* ``decode_attention_applies(q, k, v, mask, dropout_p)`` and ``decode_attention(q, k, v, mask,
  causal=, scale=)``: soft attention of a decoding step's few queries against a KV cache, one
  (batch, head) at a time, without gradients (:mod:`.attention`, :mod:`.native`).
* :mod:`.calibration`: where several of these compute one call, which is fastest on this machine,
  measured once per shape class and cached on disk (the kernels' ``applies`` predicates say only
  which can).

Imports point down only: nothing here imports from attnlab outside ``attnlab.kernels`` but the
errors module (a bad ``ATTNLAB_LINEAR`` is a ``ConfigError``);
``attnlab.nn`` imports this package, never the reverse.
"""

from attnlab.kernels.attention import decode_attention_applies, short_attention_applies
from attnlab.kernels.dropout_masks import Dropout, dropout
from attnlab.kernels.gated import fused_rotary_applies, fused_swiglu_applies
from attnlab.kernels.linear import LINEAR_KERNELS, LinearKernel, linear_kernel
from attnlab.kernels.native import decode_attention, rotary, short_attention, swiglu

__all__ = [
    "LINEAR_KERNELS",
    "Dropout",
    "LinearKernel",
    "decode_attention",
    "decode_attention_applies",
    "dropout",
    "fused_rotary_applies",
    "fused_swiglu_applies",
    "linear_kernel",
    "rotary",
    "short_attention",
    "short_attention_applies",
    "swiglu",
]
