"""attnlab's own CPU kernels (``native.cpp``, ``native_attention.cpp``), compiled with the machine's
C++ compiler on first use.

PyTorch runs two memory-bound steps of a training step on one core of a multi-core CPU:

* the transposed copy oneDNN needs for each weight gradient G^T X (:mod:`attnlab.kernels.linear`): aten's
  2-D transpose is a serial blocked loop, where :func:`transpose` copies on all cores;
* dropout's mask (:mod:`attnlab.kernels.dropout_masks`): NumPy's PCG64 draws its words serially, and three
  more passes compare, convert and scale them. :func:`scaled_keep_mask` draws the same PCG64 words
  on all cores (each thread jumps ahead to its share of the stream) and writes the scaled mask in
  one pass: the same masks, bit for bit, as the NumPy path, in less time.

Together they take two serial passes off one core in every training step (measured in
benchmarks/README.md).

:func:`short_attention` is soft attention for short heads (Vaswani Eq. 1, forward and backward).
PyTorch's CPU flash kernel cuts heads of d_k = 32 over 64 keys into GEMM calls too small to run
near the FMA units' rate; this kernel keeps one (batch, head) in L1 at a time, with register-tiled
products, and keeps the probabilities for the backward rather than recomputing them, so the
``train`` model's attention and step take less time than with PyTorch's kernel
(benchmarks/README.md).
Its two operators are registered with PyTorch (``torch.ops.attnlab.short_attention`` and
``short_attention_backward``), so dispatch modes such as ``torch.utils.flop_counter`` see them.

:func:`decode_attention` is soft attention for a decoding step: a few queries per (batch, head)
against a KV cache, scores, softmax and weighted sum of one (batch, head) at a time, where PyTorch
runs two batched GEMMs of one row per entry and a softmax between them (``native_decode_attention.cpp``).

:func:`rotary` rotates queries or keys by their positions (RoPE) in one pass, where PyTorch's ops
take five and three temporaries (``native_rotary.cpp``), for inference: ``torch.ops.attnlab.rotary``.

:func:`swiglu` is SwiGLU's SiLU(gate) * up in one pass over the activations (PyTorch makes two
and a tensor between them; ``native_swiglu.cpp``), for inference: an operator,
``torch.ops.attnlab.swiglu``.

:func:`few_rows_linear` is y = x W^T + b for an input of one to three rows (a decoding step at small
batch), on all cores: PyTorch's matrix-vector products read W on one core, at a fraction of the
rate the memory delivers to two, and a batch-1 decoding step of a language model is mostly that
read (``native_linear.cpp``; benchmarks/README.md). It is an operator too
(``torch.ops.attnlab.few_rows_linear``).

The kernels are built with ``torch.utils.cpp_extension`` (once) the first time a training step
needs them: which build, and where it is cached, is :mod:`attnlab.kernels.native_spec`; building it
once, one process at a time, and loading it is :mod:`attnlab.kernels.native_build`.

Where the build cannot run (no C++ compiler, no ``ninja``, a compiler without 128-bit integers)
:func:`kernels` returns None, the callers take PyTorch's and NumPy's paths (PyTorch's fused
attention, serial transposes, NumPy's words), and a warning says why, once. ``ATTNLAB_NATIVE=0``
in the environment skips the build.
"""

from __future__ import annotations

import math
import os
import warnings
from functools import cache
from types import ModuleType

import numpy as np
import torch
from torch import Tensor

from attnlab.errors import AttnlabWarning
from attnlab.kernels.native_build import BuildError, _load_once
from attnlab.kernels.native_spec import build_spec

__all__ = [
    "kernels",
    "available",
    "prepare",
    "unavailable_reason",
    "transpose",
    "scaled_keep_mask",
    "short_attention",
    "gradient_wanted",
    "few_rows_linear",
    "swiglu",
    "rotary",
    "decode_attention",
    "build_spec",  # from native_spec: callers name it here (attnlab.kernels.calibration)
]

_UINT64_MASK = (1 << 64) - 1
_LANES = 16  # kLanes in native_attention.cpp: the kept probabilities' rows are padded to a multiple


@cache
def _build() -> tuple[ModuleType | None, str | None]:
    if os.environ.get("ATTNLAB_NATIVE", "1") == "0":
        return None, "ATTNLAB_NATIVE=0 in the environment"
    try:
        module = _load_once(build_spec())
    except Exception as error:  # a missing compiler or ninja surfaces as several exception types
        text = str(error).strip()
        first = text.splitlines()[0] if text else ""
        ours = isinstance(error, (BuildError, TimeoutError))  # in our words: the build's reason, the wait given up
        reason = text if ours else f"{type(error).__name__}: {first}"
        warnings.warn(
            f"attnlab's CPU kernels are not available ({reason}); attnlab uses PyTorch's serial "
            "transposes, NumPy's dropout words and PyTorch's fused attention instead (slower, same results)",
            AttnlabWarning,
            stacklevel=3,
        )
        return None, reason
    _register_fake_kernels()
    return module, None


def _register_fake_kernels() -> None:
    """Shapes and layouts of the attention operators' outputs without running them, for tracing
    (``torch.compile``, FakeTensor)."""

    def heads(like: Tensor, b: int, h: int, t: int, d: int) -> Tensor:  # (B, H, T, d) laid out (B, T, H, d)
        return like.new_empty(b, t, h, d).permute(0, 2, 1, 3)

    @torch.library.register_fake("attnlab::short_attention")
    def _forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
        b, h, t_q, _ = q.shape
        t_k = k.shape[2]
        return heads(q, b, h, t_q, v.shape[3]), q.new_empty(b, h, t_k, -(-t_q // _LANES) * _LANES)

    @torch.library.register_fake("attnlab::few_rows_linear")
    def _few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return x.new_empty(x.shape[0], weight.shape[0])

    @torch.library.register_fake("attnlab::decode_attention")
    def _decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float) -> Tensor:
        b, h, t_q, _ = q.shape
        return heads(q, b, h, t_q, v.shape[3])

    @torch.library.register_fake("attnlab::rotary")
    def _rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        return x.new_empty(x.shape)

    @torch.library.register_fake("attnlab::swiglu")
    def _swiglu(hidden: Tensor) -> Tensor:
        return hidden.new_empty(hidden.shape[0], hidden.shape[1] // 2)

    @torch.library.register_fake("attnlab::short_attention_backward")
    def _backward(
        grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, probs: Tensor, scale: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        b, h, t_q, d_k = q.shape
        t_k = k.shape[2]
        return heads(q, b, h, t_q, d_k), heads(q, b, h, t_k, d_k), heads(q, b, h, t_k, v.shape[3])


def kernels() -> ModuleType | None:
    """The compiled kernels, building them on the first call; None where they cannot be built."""
    return _build()[0]


def available() -> bool:
    """Whether the kernels are built (building them on the first call)."""
    return kernels() is not None


def prepare(*devices: torch.device | str) -> None:
    """Build (or load) the kernels now where a model on one of ``devices`` may call them (a CPU).

    A command calls this once before its progress bar starts, so that the one-time build, or the
    wait for another process's, is announced and done before the bar, not inside its first step.
    Where the kernels cannot be built, the warning that says why comes here too."""
    if any(torch.device(device).type == "cpu" for device in devices):
        kernels()


def gradient_wanted(*tensors: Tensor | None) -> bool:
    """Whether autograd records this call: grad mode on and one of ``tensors`` (None skipped)
    requires a gradient. The kernels without a backward (all but :func:`short_attention`) take
    only calls where it does not."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Traced code (torch.compile) takes available()'s answer as given, not the build. This is what
# torch.compiler.assume_constant_result does, without the import of torch._dynamo it makes (over
# a second and 75 MB at every command's start); tests/unit/kernels/test_native.py checks the two agree.
available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def unavailable_reason() -> str | None:
    """Why :func:`kernels` is None (after it was called), or None where the kernels are built."""
    return _build()[1]


def _loaded() -> ModuleType:
    module = kernels()
    if module is None:
        raise RuntimeError(f"attnlab's CPU kernels are not available: {unavailable_reason()}")
    return module


def transpose(x: Tensor) -> Tensor:
    """A contiguous copy of x^T, on all cores. ``x``: a contiguous (R, C) float32 CPU tensor -> (C, R)."""
    return _loaded().transpose(x)


def scaled_keep_mask(
    shape: torch.Size | tuple[int, ...], *, seed: int, bits: int, threshold: int, scale: float
) -> Tensor:
    """float32 mask of ``shape``: ``scale`` where word i is >= ``threshold``, else 0.

    Word i is the i-th signed ``bits``-bit piece (low bits first) of the 64-bit draws of
    ``numpy.random.PCG64(seed).random_raw``: the words :func:`attnlab.kernels.dropout_masks.keep_mask` compares.
    """
    state = np.random.PCG64(seed).state["state"]  # the 128-bit LCG state and increment after seeding
    lcg, inc = state["state"], state["inc"]
    mask = _loaded().scaled_keep_mask(
        math.prod(shape), bits, lcg >> 64, lcg & _UINT64_MASK, inc >> 64, inc & _UINT64_MASK, threshold, scale
    )
    return mask.view(shape)


SHORT_ATTENTION_MAX_KEYS = 256
"""The most keys :func:`short_attention` takes (kMaxKeys in native_attention.cpp)."""
SHORT_ATTENTION_MAX_HEAD_DIM = 256
"""The widest head (d_k, d_v) :func:`short_attention` takes (kMaxHeadDim in native_attention.cpp)."""
SHORT_ATTENTION_MAX_QUERIES = 256
"""The most queries :func:`attnlab.kernels.short_attention_applies` hands the kernel. It takes more, but a
head's kept probabilities then outgrow L2 and PyTorch's fused kernel is faster
(benchmarks/README.md)."""


def short_attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float) -> Tensor:
    """softmax(scale Q K^T) V, one (batch, head) in L1 at a time, with its backward (``native_attention.cpp``).

        Attention(Q, K, V) = softmax(scale Q K^T) V                       (Vaswani et al. §3.2.1, Eq. 1)

    ``causal`` gives 0 weight to keys after each query's position, bottom-right aligned when
    T_k > T_q (query i sees keys j <= i + T_k - T_q), as :func:`attnlab.nn.attention.attention` does.
    The backward uses the probabilities the forward keeps, (B, H, T_k, T_q rounded up to 16) floats.

    Args:
        q: queries.
        k: keys.
        v: values.
        causal: mask keys after each query's position.
        scale: multiplies Q K^T (1/sqrt(d_k) in Eq. 1).

    Shape:
        q: (B, H, T_q, d_k);  k: (B, H, T_k, d_k);  v: (B, H, T_k, d_v), float32 on the CPU, unit
        stride in d, T_k <= :data:`SHORT_ATTENTION_MAX_KEYS`; returns (B, H, T_q, d_v), laid out
        as (B, T_q, H, d_v), so the heads' concatenation is a view.

    Returns:
        The attention output, differentiable with respect to q, k and v.
    """
    if not available():
        _loaded()  # raises, naming the reason
    return _ShortAttention.apply(q, k, v, causal, scale)


def few_rows_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b with W's rows split over all cores, for inputs of a few rows (``native_linear.cpp``).

    Each output is summed in float32 in an order that depends on d_in alone; bfloat16 inputs are
    widened exactly as they are read and the output rounded to bfloat16 once. No gradient: callers
    take ``F.linear`` where one is needed.

    Args:
        x: the inputs.
        weight: W, contiguous.
        bias: b, contiguous, or None.

    Shape:
        x: (..., d_in) float32 or bfloat16 on the CPU, of W's dtype, few rows (the kernel reads W
        once per 4 rows of x);
        weight: (d_out, d_in); bias: (d_out,); returns (..., d_out).
    """
    _loaded()
    return torch.ops.attnlab.few_rows_linear(_rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


DECODE_ATTENTION_MAX_QUERIES = 4
"""The most queries per (batch, head) :func:`attnlab.kernels.decode_attention_applies` hands
:func:`decode_attention` (a decoding step has one, or a group's under grouped-query attention). It
takes more, but from about 8 queries over up to 256 keys :func:`short_attention` is faster
(benchmarks/README.md)."""


def decode_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, *, causal: bool, scale: float) -> Tensor:
    """softmax(mask(scale Q K^T)) V, one (batch, head) at a time (``native_decode_attention.cpp``).

        Attention(Q, K, V) = softmax(scale Q K^T) V                       (Vaswani et al. §3.2.1, Eq. 1)

    Keys the mask forbids (False) and, with ``causal``, keys after a query's position
    (bottom-right aligned) get weight 0; a query that may see no key gets zeros. No gradient.

    Args:
        q: queries.
        k: keys (a KV cache's view is fine: any strides with unit stride in d).
        v: values.
        mask: True where a query may attend; broadcastable to (B, H, T_q, T_k); or None.
        causal: mask keys after each query's position.
        scale: multiplies Q K^T.

    Shape:
        q: (B, H, T_q, d_k); k: (B, H, T_k, d_k); v: (B, H, T_k, d_v), float32 on the CPU; returns
        (B, H, T_q, d_v), laid out as (B, T_q, H, d_v), so the heads' concatenation is a view.
    """
    _loaded()  # the operator is registered when the kernels load (raises, naming why, if they cannot)
    if mask is not None:
        mask = mask.expand(*q.shape[:-1], k.shape[-2])  # (B, H, T_q, T_k), a view
    return torch.ops.attnlab.decode_attention(q, k, v, mask, causal, scale)


def rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x cos(m theta) + rotate_half(x) sin(m theta) in one pass (``native_rotary.cpp``).

        RoPE(x, m) = x cos(m theta) + rotate_half(x) sin(m theta)       (Su et al. 2021, Eq. 34)

    No gradient: callers take PyTorch's ops where one is needed.

    Shape:
        x: (B, H, T, d) float32 on the CPU, unit stride in d; cos, sin: (B or 1, 1, T, d);
        returns (B, H, T, d), contiguous.
    """
    _loaded()
    return torch.ops.attnlab.rotary(x, cos.squeeze(1).contiguous(), sin.squeeze(1).contiguous())


def swiglu(hidden: Tensor) -> Tensor:
    """SiLU(gate) * up in one pass over [gate, up] side by side (``native_swiglu.cpp``).

        h = SiLU(g) * u = g sigmoid(g) u                        (Shazeer 2020, Eq. 6)

    No gradient: callers take PyTorch's ops where one is needed.

    Shape:
        hidden: (..., 2 d_ff) float32 on the CPU, unit stride in the last dim -> (..., d_ff).
    """
    _loaded()
    return torch.ops.attnlab.swiglu(_rows(hidden)).view(*hidden.shape[:-1], hidden.shape[-1] // 2)


def _rows(x: Tensor) -> Tensor:
    """``x`` as (R, d), R = all its leading dims (a view where it can be), with unit stride in d."""
    rows = x.reshape(-1, x.shape[-1])  # (R, d)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _ShortAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:  # noqa: ANN001
        output, probs = torch.ops.attnlab.short_attention(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, probs)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx, grad_output: Tensor) -> tuple[Tensor, Tensor, Tensor, None, None]:  # noqa: ANN001
        q, k, v, probs = ctx.saved_tensors
        if grad_output.stride(-1) != 1:
            grad_output = grad_output.contiguous()
        grads = torch.ops.attnlab.short_attention_backward(grad_output, q, k, v, probs, ctx.scale)
        if torch.is_grad_enabled():  # create_graph=True: differentiating these gradients must fail loudly
            grads = _NoSecondDerivative.apply(*grads, q, k, v)
        return (*grads, None, None)


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the gradients through; a derivative of them raises (as for PyTorch's fused kernels)."""

    @staticmethod
    def forward(  # noqa: ANN001
        ctx, grad_q: Tensor, grad_k: Tensor, grad_v: Tensor, *inputs: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        del ctx, inputs  # the inputs only tie these gradients to the graph
        return grad_q.clone(), grad_k.clone(), grad_v.clone()

    @staticmethod
    def backward(ctx, *grads: Tensor) -> None:  # noqa: ANN001
        raise RuntimeError(
            "attnlab's short attention kernel has no second derivative (nor has PyTorch's fused "
            "attention); ask attention() for the weights (need_weights / return_weights) to take the "
            "explicit path, which has one"
        )
