"""The linear maps of every layer, y = x W^T + b, and the GEMM kernels that compute them.

Every projection of the model is this affine map: W^Q, W^K, W^V and W^O of multi-head attention
(Vaswani §3.2.2), the two maps of the FFN (Vaswani §3.3, Eq. 2; Agarwal Def. 6.5), and the output
layer. They hold most of a training step's time, so which fp32 GEMM runs them matters more than
anything else the model does on a CPU.

Kernels, in the registry :data:`LINEAR_KERNELS` (name -> a factory; each module makes its own):

* ``aten``: ``torch.nn.functional.linear``. On a CPU it runs fp32 GEMMs through MKL, which keeps its
  AVX2 kernels on AMD processors even where they have AVX-512.
* ``onednn``: :class:`OneDNNLinear`, the same map through PyTorch's oneDNN fp32 matmul
  (``torch.ops.mkldnn._linear_pointwise``), which picks its kernels from the processor's features.
  Forward and both gradients run there. It is full fp32 (no reduced-precision accumulation). On a
  Zen 5 EPYC (AVX-512) it ran the model's GEMMs far faster than MKL, on a Zen 4 EPYC no faster
  (benchmarks/README.md). A map with fewer than :data:`MIN_ONEDNN_ROWS` rows (one decoding step at
  batch 1) takes attnlab's native matrix-vector kernel, which reads W on all cores
  (:func:`attnlab.kernels.native.few_rows_linear`; ``F.linear`` where a gradient is needed or the
  kernel is not built): there oneDNN's fixed cost per call is larger than MKL's, and both read W on
  one core. A bfloat16 map of a few rows takes the same kernel where it is faster than PyTorch's
  bfloat16 product, which streams W at a fraction of the memory's rate (``auto`` measures); a
  bfloat16 map of more rows without a gradient may take oneDNN with the weight packed for it (where
  the processor runs bfloat16 there; PyTorch's own bfloat16 product calls oneDNN on the unpacked
  weight each time); every other tensor that is not a float32 CPU tensor takes ``F.linear``
  (oneDNN has no float64 kernel).

Which kernel runs is a runtime setting, not part of a model's architecture: ``ATTNLAB_LINEAR`` in
the environment (:func:`linear_setting`), read when a module is built: ``aten``, ``onednn``, or
``auto`` (the default, :class:`MeasuredLinear`), which takes, for each shape class of a map (its
rows rounded up to a power of two, d_in, d_out, a bias, whether a gradient is wanted), whichever
of ``aten``, ``onednn`` (4 rows and more) and the few-rows kernel (1 to 3 rows, no gradient) ran
it fastest on this machine, measured at its first call (:mod:`attnlab.kernels.calibration`). On
the AVX2-only EPYC that measured the project's earlier benchmarks, oneDNN's fp32 linear was no
faster than MKL's; on a Zen 5 it was far faster: the answer is the machine's.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor

from attnlab.errors import ConfigError
from attnlab.kernels import calibration, native

__all__ = [
    "LinearKernel",
    "LINEAR_KERNELS",
    "MIN_ONEDNN_ROWS",
    "aten_linear",
    "OneDNNLinear",
    "packed_weights",
    "onednn_available",
    "MeasuredLinear",
    "available_linear_kernels",
    "linear_setting",
    "linear_kernel",
]

LinearKernel = Callable[[Tensor, Tensor, "Tensor | None"], Tensor]
"""(x (..., d_in), weight (d_out, d_in), bias (d_out,) or None) -> (..., d_out)."""

MIN_ONEDNN_ROWS = 4
"""Fewer rows than this go to ``F.linear``: oneDNN's cost per call beats MKL's only from 4 rows
(the crossover measured on the model's shapes; benchmarks/README.md)."""


def aten_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """y = x W^T + b through ``torch.nn.functional.linear``."""
    return F.linear(x, weight, bias)


@cache
def onednn_available() -> bool:
    """Whether this PyTorch build has oneDNN and its dense fp32 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


@cache
def onednn_bf16_available() -> bool:
    """Whether oneDNN runs bfloat16 linear maps on this processor (AVX-512 with BF16, or AMX)."""
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _onednn_matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x W^T (+ b) on oneDNN; ``x`` (..., d_in) and ``weight`` (d_out, d_in) may be strided views,
    or ``weight`` a packed copy from :func:`_pack`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _pack(weight: Tensor, rows: int) -> Tensor:
    """``weight`` in oneDNN's blocked layout for ``rows``-row inputs (an opaque mkldnn tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _weight_gradient(grad_rows: Tensor, x_rows: Tensor) -> Tensor:
    """dL/dW = G^T X, (d_out, d_in), from G (R, d_out) and X (R, d_in).

    oneDNN's first operand must be row-major, so one of X^T and G^T is copied: on all cores by
    :mod:`attnlab.kernels.native` where it is built (aten's 2-D transpose is serial).

    oneDNN streams its second operand as the "weight" of a linear map, and runs this reduction over
    R fastest when that operand is the wider of the two (benchmarks/README.md), so the product is
    formed as (X^T G)^T when d_out is the wider.
    """
    if grad_rows.shape[1] >= x_rows.shape[1]:
        return _onednn_matmul(_transposed(x_rows), grad_rows.t()).t().contiguous()  # (X^T G)^T: (d_out, d_in)
    return _onednn_matmul(_transposed(grad_rows), x_rows.t())  # G^T X: (d_out, d_in)


def _transposed(rows: Tensor) -> Tensor:
    """rows^T for oneDNN's first operand, which it needs row-major: a copy on all cores from
    :mod:`attnlab.kernels.native` where that is built, else the transposed view (oneDNN's op then copies
    it with aten's serial transpose)."""
    if rows.is_contiguous() and native.available():
        return native.transpose(rows)  # (C, R)
    return rows.t()


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
        # Dense: an expanded gradient (that of y.sum(), stride 0) sends oneDNN down a reference
        # path 100 times slower. A no-op for the dense gradient a loss sends back.
        grad_rows = grad.contiguous().view(-1, d_out)  # (R, d_out), R = all leading dims of x
        need_x, need_weight, need_bias = (_used_by_this_backward(ctx, index) for index in range(3))
        grad_x = _onednn_matmul(grad_rows, weight.t()).view(x.shape) if need_x else None  # G W
        grad_weight = _weight_gradient(grad_rows, x.reshape(-1, d_in)) if need_weight else None
        grad_bias = grad_rows.sum(0) if need_bias and ctx.has_bias else None
        return grad_x, grad_weight, grad_bias


def _used_by_this_backward(ctx, index: int) -> bool:  # noqa: ANN001
    """Whether the running backward pass uses the gradient of input ``index``.

    ``torch.autograd.grad(loss, [xi])`` asks for fewer gradients than the inputs that require one
    (head importance wants dL/dxi and no weight gradient). PyTorch's own linear skips what the
    engine will not use; a custom Function must ask the engine, or it forms dL/dW for nothing (one
    third of the backward's GEMMs). The engine answers for every node but a leaf that
    ``autograd.grad`` was asked for, whose gradient is then wanted.
    """
    if not ctx.needs_input_grad[index]:
        return False
    node = ctx.next_functions[index][0]
    if node is None:
        return False
    try:
        return torch._C._will_engine_execute_node(node)
    except RuntimeError:  # a leaf autograd.grad() was asked for: its gradient is the answer
        return True


class _Scope:
    """One :func:`packed_weights` region: the kernels that packed a weight in it, whose copies go when it ends."""

    __slots__ = ("kernels", "__weakref__")

    def __init__(self) -> None:
        self.kernels: weakref.WeakSet[OneDNNLinear] = weakref.WeakSet()

    def close(self) -> None:
        for kernel in list(self.kernels):
            kernel._packed.clear()
        self.kernels.clear()


_ACTIVE_SCOPE: ContextVar[_Scope | None] = ContextVar("attnlab_packed_weights", default=None)
"""The :func:`packed_weights` region this thread (or task) is in, if any: attnlab's own state, read
by its kernels only; nothing is registered with PyTorch."""


@contextmanager
def packed_weights() -> Iterator[None]:
    """A region of inference in which oneDNN's packed copies of the weights may be made and reused.

    Packing pays where one weight is read many times with one row count: the steps of a decoding
    loop, the batches of an evaluation, a benchmark's repeats (:class:`OneDNNLinear`). attnlab's
    decoding loops (:mod:`attnlab.generate.search`) and :func:`attnlab.evaluation.evaluate.evaluate`
    enter one; outside any, no weight is packed. Every copy made inside is dropped when the region
    ends, so nothing made during an evaluation survives into the training steps after it.

    Inside, the weights are read, not written: a copy is still dropped where its parameter's version
    counter or storage moved (``load_state_dict``, ``param.data = ...``, an in-place write under
    ``no_grad``), but writes that bypass the counter (``param.data.mul_(2)``, PyTorch's fused
    optimizers) are seen only at the region's end. A region inside another is the outer one.
    Thread- and task-local (a :class:`contextvars.ContextVar`); usable as a decorator.
    """
    if _ACTIVE_SCOPE.get() is not None:
        yield
        return
    scope = _Scope()
    token = _ACTIVE_SCOPE.set(scope)
    try:
        yield
    finally:
        _ACTIVE_SCOPE.reset(token)
        scope.close()


@dataclass
class _Packed:
    """A packed copy of one weight, valid inside the region it was made in while that weight is unchanged."""

    owner: weakref.ref  # the parameter the weight is (or is a view of)
    data_ptr: int
    version: int  # the weight's version counter: most in-place writes bump it
    rows: int  # the row count of the last unpacked use: a second use with as many rows packs
    packed: Tensor | None  # None: not packed yet
    scope: _Scope  # the packed_weights() region it was made in

    def fits(self, owner: Tensor, weight: Tensor, scope: _Scope) -> bool:
        return (
            self.scope is scope
            and self.owner() is owner
            and self.data_ptr == weight.data_ptr()
            and self.version == weight._version
        )


class OneDNNLinear:
    """y = x W^T + b on oneDNN for float32 CPU tensors of at least :data:`MIN_ONEDNN_ROWS` rows, and
    bfloat16 ones without a gradient where the processor runs them; ``F.linear`` for the rest
    (other devices and dtypes, single decoding rows, bfloat16 gradients) and inside autocast,
    whose casts apply to PyTorch's ops only (``train.precision = "bf16"`` must run bf16 GEMMs).

    Without gradients, inside a :func:`packed_weights` region (attnlab's decoding loops and
    evaluation enter one), each weight is packed once into oneDNN's blocked layout and the packed
    copy reused until the region ends, as long as the weight is the same tensor with the same
    storage and version counter (which in-place writes such as ``load_state_dict`` bump). Outside a
    region nothing is packed: PyTorch's fused optimizers and ``.data`` edits write a weight without
    bumping its counter, and only the region's end says for certain that a copy may be stale.
    Unpacked, oneDNN lays the weight out again on every call, which slows decoding steps measurably
    (benchmarks/README.md). A weight is packed at its second use with as many rows as the use
    before, the sign of a repeated shape (decoding steps, batches of one size, a benchmark's
    repeats): a prompt read once at batch 1, or prompts of different lengths read one after another
    (``attnlab generate RUN "a" "b c"``), pack nothing. Packed copies cost the weights' memory once
    more while the region lasts; a forward pass that needs a weight's gradient drops that weight's
    copy, so training keeps none.

    One instance per module (:func:`linear_kernel` makes them), so the copies live and die with the
    module whose weights they are (and the region they were made in).
    """

    def __init__(self, scope: _Scope | None = None) -> None:
        self._packed: dict[tuple[int, int, tuple[int, ...]], _Packed] = {}
        self._scope = scope  # a region of its own (a timing's, on weights it owns), else the caller's

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        # The row count first: a decoding step at batch 1 calls this 19 times per layer and leaves here.
        if x.numel() < MIN_ONEDNN_ROWS * max(x.shape[-1], 1):
            return _few_rows(x, weight, bias)
        if not _onednn_runs(x, weight):
            return F.linear(x, weight, bias)
        if torch.is_autocast_enabled(x.device.type):  # mixed precision: autocast casts F.linear's inputs
            return F.linear(x, weight, bias)  # (PyTorch runs its bf16 GEMMs on oneDNN itself)
        if native.gradient_wanted(x, weight, bias):
            if self._packed:  # training: this weight changes every step, so its copy is dropped
                self._packed.pop(_key(_owner(weight), weight), None)
            if weight.dtype != torch.float32:  # oneDNN's gradients here are float32's
                return F.linear(x, weight, bias)
            return _OneDNNLinear.apply(x, weight, bias)
        scope = self._scope or _ACTIVE_SCOPE.get()
        if scope is None or not weight.is_contiguous():
            return _onednn_matmul(x, weight, bias)
        return _onednn_matmul(x, self._packed_weight(weight, x.numel() // x.shape[-1], scope), bias)

    def _packed_weight(self, weight: Tensor, rows: int, scope: _Scope) -> Tensor:
        """The packed copy of ``weight``, made at its second use with ``rows`` rows in a row: a
        weight used once, or with another row count each time (the prompts of a generation, whose
        later steps take the few-rows kernel), is never packed, so it is never held twice."""
        owner = _owner(weight)
        key = _key(owner, weight)
        entry = self._packed.get(key)
        if entry is None or not entry.fits(owner, weight, scope):
            self._packed[key] = _Packed(weakref.ref(owner), weight.data_ptr(), weight._version, rows, None, scope)
            scope.kernels.add(self)
            return weight
        if entry.packed is None:
            if entry.rows != rows:
                entry.rows = rows
                return weight
            entry.packed = _pack(weight, rows)
        return entry.packed

    def __deepcopy__(self, memo: dict) -> OneDNNLinear:
        return OneDNNLinear()  # a copied module has weights of its own: it packs them itself

    def __getstate__(self) -> dict:
        return {"_packed": {}, "_scope": None}  # packed copies are oneDNN's opaque tensors: never serialised

    def __repr__(self) -> str:
        return f"OneDNNLinear(packed={len(self._packed)})"


def _few_rows(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x W^T + b for fewer than :data:`MIN_ONEDNN_ROWS` rows: the native kernel, whose threads
    share the read of W (:func:`attnlab.kernels.native.few_rows_linear`), where no gradient is
    needed and it is built; ``F.linear`` otherwise."""
    if (
        _few_rows_runs(x, weight)
        and weight.is_contiguous()
        and (bias is None or bias.is_contiguous())
        and not native.gradient_wanted(x, weight, bias)
        and not torch.is_autocast_enabled("cpu")
        and native.available()
    ):
        return native.few_rows_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _few_rows_unchecked(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """:func:`attnlab.kernels.native.few_rows_linear` for a call whose class :func:`_linear_applies`
    already took (float32 or bfloat16 CPU, no gradient, W and b contiguous, the kernels built)."""
    return torch.ops.attnlab.few_rows_linear(native._rows(x), weight, bias).view(*x.shape[:-1], weight.shape[0])


def _owner(weight: Tensor) -> Tensor:
    """The parameter ``weight`` is, or is a view of (W^Q is a view of in_proj_weight)."""
    return weight if weight._base is None else weight._base


def _key(owner: Tensor, weight: Tensor) -> tuple[int, int, tuple[int, ...]]:
    return id(owner), weight.storage_offset(), tuple(weight.shape)


def _onednn_runs(x: Tensor, weight: Tensor) -> bool:
    """A CPU map oneDNN takes: float32, or bfloat16 where the processor has it (x of W's dtype)."""
    return (
        x.dtype == weight.dtype
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and onednn_bf16_available()))
        and x.device.type == "cpu"
        and weight.numel() > 0
    )


def _few_rows_runs(x: Tensor, weight: Tensor) -> bool:
    """A CPU map in float32 or bfloat16 (x of W's dtype): the few-rows kernel's, and the measured choice's."""
    return (
        x.dtype == weight.dtype
        and weight.dtype in (torch.float32, torch.bfloat16)
        and x.device.type == "cpu"
        and weight.numel() > 0
    )


LINEAR_KERNELS: dict[str, Callable[[], LinearKernel]] = {
    "aten": lambda: aten_linear,
    "onednn": OneDNNLinear,
}
"""Registry of GEMM kernels for the model's linear maps: name -> a factory of the kernel one module
calls; ``auto`` (:class:`MeasuredLinear`) takes the fastest of them for each shape class."""


def _gemm_preference(onednn: LinearKernel) -> dict[str, LinearKernel]:
    """aten (MKL) and oneDNN in the order a fixed record takes them on this processor (see
    :class:`MeasuredLinear`): oneDNN first where PyTorch reports AVX-512, else aten."""
    if torch.backends.cpu.get_cpu_capability().startswith("AVX512"):
        return {"onednn": onednn, "aten": aten_linear}
    return {"aten": aten_linear, "onednn": onednn}


class MeasuredLinear:
    """y = x W^T + b by whichever kernel ran this map's shape class fastest on this machine.

    float32 CPU maps outside autocast are sorted into classes (rows rounded up to a power of two,
    d_out, d_in, a bias, whether a gradient is wanted); the candidates of a class are ``aten``
    (``F.linear``), ``onednn`` (:class:`OneDNNLinear`, from :data:`MIN_ONEDNN_ROWS` rows) and
    ``few_rows`` (:func:`attnlab.kernels.native.few_rows_linear`, fewer rows, no gradient). The
    first call of a class times them on its own inputs (:mod:`attnlab.kernels.calibration`); later
    calls look the answer up. Every other map takes ``F.linear``.

    One instance per module, as :class:`OneDNNLinear`, whose packed weights it keeps.
    """

    def __init__(self) -> None:
        self._onednn = OneDNNLinear()
        # The order is the preference between kernels timed within calibration.TIE of each other, and
        # the choice of a fixed kernel record (never timed): the few-rows kernel first, so a decoding
        # step's maps stay on PyTorch's intra-op threads rather than switching to MKL's
        # single-threaded product and back, which costs a few microseconds a switch
        # (benchmarks/README.md); then oneDNN before MKL where the processor has AVX-512 (MKL keeps
        # its AVX2 kernels on AMD's: on a Zen 5 EPYC oneDNN ran the model's GEMMs at twice MKL's
        # rate, on a Zen 4 as fast), MKL before oneDNN elsewhere (on an AVX2 Zen 3 MKL was timed
        # faster for every map with a gradient).
        self._kernels: dict[str, LinearKernel] = {"few_rows": _few_rows, **_gemm_preference(self._onednn)}
        # This module's classes already looked up: (rows, grad, W's shape, W and b contiguous) -> the kernel
        # to call. A decoding step calls ~20 maps per layer, each a few microseconds of work: the
        # class's key and its dictionary lookups were a tenth of that.
        self._calls: dict[tuple, LinearKernel] = {}

    def __call__(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        if not _few_rows_runs(x, weight) or torch.is_autocast_enabled("cpu"):
            return F.linear(x, weight, bias)
        rows = x.numel() // x.shape[-1]
        grad = native.gradient_wanted(x, weight, bias)
        # oneDNN runs packed weights inside a packed_weights() region only: timed as it would run
        packs = not grad and rows >= MIN_ONEDNN_ROWS and _ACTIVE_SCOPE.get() is not None
        seen = (
            rows if rows < MIN_ONEDNN_ROWS else calibration.bucket(rows),
            grad,
            packs,
            weight.dtype,
            *weight.shape,
            weight.is_contiguous(),
            None if bias is None else bias.is_contiguous(),
            calibration.active_record(),  # a model's own record answers apart from this process's choices
        )
        kernel = self._calls.get(seen)
        if kernel is None:
            kernel = self._kernel_for(x, weight, bias, rows, grad, packs)
            if calibration.can_measure():  # else nothing was measured: ask again next time
                self._calls[seen] = kernel
        return kernel(x, weight, bias)

    def _kernel_for(
        self, x: Tensor, weight: Tensor, bias: Tensor | None, rows: int, grad: bool, packs: bool
    ) -> LinearKernel:
        """The kernel measured (now, or earlier in this process or on this machine) for this call's
        class; ``packs``: inside a :func:`packed_weights` region, where oneDNN packs its weights."""
        key = ("linear", calibration.bucket(rows), weight.shape, bias is None, grad)
        if weight.dtype != torch.float32:
            key = (*key, str(weight.dtype).removeprefix("torch."))
        if not grad and rows >= MIN_ONEDNN_ROWS and not packs:  # oneDNN unpacked: a class of its own
            key = (*key, "unpacked")
        name = calibration.chosen(key)
        if name is None or not _linear_applies(name, rows, weight, bias, grad):
            names = [each for each in self._kernels if _linear_applies(each, rows, weight, bias, grad)]
            if len(names) == 1 or not calibration.can_measure():
                name = calibration.first(key, names)  # the first in the order above
            else:  # the disk cache first: preparing the timed candidates copies and packs W
                name = calibration.recall(key, names) or calibration.choose(
                    key,
                    {each: _timed_linear(each, x, weight, bias, grad, packs) for each in names},
                    tie=SWITCH_MARGIN if names[0] == "few_rows" else None,
                )
        return _few_rows_unchecked if name == "few_rows" else self._kernels[name]

    def __deepcopy__(self, memo: dict) -> MeasuredLinear:
        return MeasuredLinear()  # a copied module has weights of its own: it packs them itself

    def __reduce__(self) -> tuple:
        return MeasuredLinear, ()  # packed copies are oneDNN's opaque tensors: never serialised

    def __repr__(self) -> str:
        return "MeasuredLinear()"


def _linear_applies(name: str, rows: int, weight: Tensor, bias: Tensor | None, grad: bool) -> bool:
    """Whether kernel ``name`` of :class:`MeasuredLinear` takes a CPU map of ``rows`` rows (float32,
    or bfloat16: oneDNN for inference only, where the processor runs it)."""
    if name == "onednn":
        if weight.dtype == torch.bfloat16:
            return rows >= MIN_ONEDNN_ROWS and not grad and onednn_bf16_available()
        return rows >= MIN_ONEDNN_ROWS and weight.dtype == torch.float32 and onednn_available()
    if name == "few_rows":
        return (
            0 < rows < MIN_ONEDNN_ROWS
            and not grad
            and weight.is_contiguous()
            and (bias is None or bias.is_contiguous())
            and native.available()
        )
    return True


SWITCH_MARGIN = 0.25
"""A decoding step's map (a few rows, no gradient) leaves the few-rows kernel, which its neighbours
run on, only for a kernel timed more than this much faster: a step whose 256 x 256 maps went to
MKL's product, timed about as fast alone, ran 15-30% slower on the Zen 4 than one on the few-rows
kernel throughout (benchmarks/README.md), a cost of switching that a timing of one map misses."""

MAX_TIMED_COPIES = 16
"""At most this many copies of a weight are timed: a weight so small that more would be needed
(under 1/8 of the core's cache) stays cached in a forward pass anyway."""


def _timed_linear(
    name: str, x: Tensor, weight: Tensor, bias: Tensor | None, grad: bool, packs: bool = True
) -> Callable[[], object]:
    """One call of kernel ``name`` on detached views of the inputs, to time: forward only, or
    forward and backward on fresh leaves where a gradient is wanted (nothing is recorded in the
    caller's graph). oneDNN runs on an instance of its own, with a :func:`packed_weights` region of
    its own where ``packs`` (the call came from inside one), whose packed weights are dropped after.

    Each call takes the next of enough copies of the weight to fill twice this core's private
    cache (:func:`attnlab.kernels.calibration.cache_bytes`; the weight itself where it is that
    large): in a forward pass the other layers' weights pass through the cache between two reads
    of this one, and timing one small weight over and over, always cached, favoured aten's
    single-threaded matrix-vector product where the model's decoding step ran faster on the
    few-rows kernel, which reads W on all cores (benchmarks/README.md).

    A map of a few rows (a decoding step's) is timed after a neighbour, the few-rows kernel on
    another copy of W, the same for every candidate: in a decoding step each map follows kernels
    on PyTorch's intra-op threads (the attention, the other maps), and MKL's product after them
    paid a switch of a few microseconds that a lone timing never saw (on the Zen 4 it took a
    256 x 256 map: 10.1 against 10.3 us alone, 18 against 11.7 us after the few-rows kernel).
    """
    if name == "onednn":
        kernel: LinearKernel = OneDNNLinear(_Scope() if packs and not grad else None)
    else:
        kernel = {"aten": aten_linear, "few_rows": _few_rows}[name]
    copies = min(
        MAX_TIMED_COPIES, max(1, -(-2 * calibration.cache_bytes() // max(weight.numel() * weight.element_size(), 1)))
    )
    weights = [_leaf(weight)] + [_leaf(weight, copy=True) for _ in range(copies - 1)]
    x, bias = _leaf(x), None if bias is None else _leaf(bias)
    turn = [0]

    def next_weight() -> Tensor:
        turn[0] = (turn[0] + 1) % copies
        return weights[turn[0]]

    if not grad:
        if name == "onednn" and packs:  # used twice with these rows: each copy packed as the weight would be
            for w in weights * 2:
                kernel(x, w, bias)
        if not _linear_applies("few_rows", x.numel() // max(x.shape[-1], 1), weight, bias, grad):
            return lambda: kernel(x, next_weight(), bias)
        neighbour = _leaf(weight, copy=True)

        def after_a_neighbour() -> object:
            _few_rows_unchecked(x, neighbour, bias)  # the same for every candidate
            return kernel(x, next_weight(), bias)

        return after_a_neighbour

    def run_with_backward() -> object:
        w = next_weight()
        output = kernel(x, w, bias)
        wanted = [t for t in (x, w, bias) if t is not None and t.requires_grad]
        return torch.autograd.grad(output, wanted, torch.ones_like(output))  # dense, as a loss's

    return run_with_backward


def _leaf(t: Tensor, copy: bool = False) -> Tensor:
    """A detached leaf (a copy with ``copy``) of ``t`` that requires a gradient where ``t`` does."""
    if not copy:
        return t.detach().requires_grad_(t.requires_grad)
    with torch.inference_mode(False):  # a normal tensor, as the weight is, also under inference_mode
        return t.detach().clone().requires_grad_(t.requires_grad)


LINEAR_SETTINGS = ("auto", *LINEAR_KERNELS)
"""The values of ``ATTNLAB_LINEAR``: ``auto`` (measured, the default) or a kernel's name."""


def available_linear_kernels() -> list[str]:
    """The kernels of :data:`LINEAR_KERNELS` this PyTorch build can run (``onednn`` needs oneDNN)."""
    return [name for name in LINEAR_KERNELS if name != "onednn" or onednn_available()]


def linear_setting() -> str:
    """``ATTNLAB_LINEAR`` from the environment (default ``auto``); a ConfigError naming the
    variable where it is not ``auto`` or a kernel this PyTorch build can run."""
    name = os.environ.get("ATTNLAB_LINEAR") or "auto"
    if name not in LINEAR_SETTINGS:
        raise ConfigError(f"ATTNLAB_LINEAR: unknown {name!r}; allowed: {', '.join(LINEAR_SETTINGS)}")
    if name != "auto" and name not in available_linear_kernels():
        raise ConfigError(
            f"ATTNLAB_LINEAR: {name!r} needs a PyTorch build with oneDNN (torch.backends.mkldnn); use 'aten' or 'auto'"
        )
    return name


def linear_kernel(name: str | None = None) -> LinearKernel:
    """A new kernel for one module: ``name`` (a kernel of :data:`LINEAR_KERNELS` or ``auto``), by
    default the runtime setting :func:`linear_setting`."""
    name = linear_setting() if name is None else name
    if name == "auto":
        return MeasuredLinear()
    if name not in available_linear_kernels():
        raise ValueError(
            f"linear kernel: unknown or unavailable {name!r}; allowed: {', '.join(available_linear_kernels())}, auto"
        )
    return LINEAR_KERNELS[name]()
