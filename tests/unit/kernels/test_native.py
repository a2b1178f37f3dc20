"""attnlab's C++ CPU kernels: the same results as the PyTorch and NumPy paths they replace."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from attnlab import kernels
from attnlab.kernels import dropout_masks as dropout_module
from attnlab.kernels import linear as linear_module
from attnlab.kernels import native
from attnlab.kernels.dropout_masks import dropout, keep_mask, realised_rate, signed_threshold, word_bits

pytestmark = pytest.mark.skipif(not native.available(), reason=f"no C++ kernels: {native.unavailable_reason()}")


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (65, 130), (2048, 256), (17, 1), (1, 300)])
def test_transpose_is_the_contiguous_transposed_copy(shape):
    x = torch.randn(shape)
    out = native.transpose(x)
    assert out.is_contiguous() and out.shape == (shape[1], shape[0])
    assert torch.equal(out, x.t().contiguous())


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(1, 200), cols=st.integers(1, 200))
def test_transpose_property(rows, cols):
    x = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)
    assert torch.equal(native.transpose(x), x.t().contiguous())


def test_transpose_rejects_what_it_cannot_copy():
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        native.transpose(torch.randn(4, 5).t())
    with pytest.raises(RuntimeError, match="contiguous 2-D float32"):
        native.transpose(torch.randn(4, 5, dtype=torch.float64))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9, 0.002, 1e-4])  # 16-bit words, then 32-bit
@pytest.mark.parametrize("shape", [(1,), (7, 5), (3, 11, 13), (32, 64, 256), (0, 4)])
def test_scaled_mask_is_keep_mask_scaled_bit_for_bit(p, shape):
    scale = 1.0 / (1.0 - realised_rate(p))
    torch.manual_seed(3)
    expected = keep_mask(shape, p).to(torch.float32) * scale
    torch.manual_seed(3)
    seed = dropout_module._numpy_seed()
    got = native.scaled_keep_mask(shape, seed=seed, bits=word_bits(p), threshold=signed_threshold(p), scale=scale)
    assert got.dtype == torch.float32 and got.shape == torch.Size(shape)
    assert torch.equal(got, expected)


def test_scaled_mask_words_are_numpys_pcg64_stream():
    # All-keep threshold at the signed minimum, so the mask reads the scale everywhere, and a
    # threshold between two words read off NumPy's own draws: entry i is kept iff word i >= it.
    words = np.random.PCG64(123).random_raw(40).view(np.int16)[:157]
    threshold = int(np.median(words))
    got = native.scaled_keep_mask((157,), seed=123, bits=16, threshold=threshold, scale=2.0)
    assert torch.equal(got, torch.from_numpy((words >= threshold).astype(np.float32) * 2.0))


@pytest.mark.parametrize("p", [0.1, 0.003])
def test_dropout_gives_the_same_output_with_and_without_the_kernels(p, monkeypatch):
    x = torch.randn(4, 33, 17)
    torch.manual_seed(0)
    with_kernels = dropout(x, p, True)
    monkeypatch.setattr(native, "kernels", lambda: None)
    torch.manual_seed(0)
    assert torch.equal(dropout(x, p, True), with_kernels)


def test_weight_gradients_are_the_same_with_and_without_the_kernels(monkeypatch):
    if not linear_module.onednn_available():
        pytest.skip("no oneDNN")
    torch.manual_seed(0)
    kernel = linear_module.OneDNNLinear()
    grads = []
    for use_kernels in (True, False):
        if not use_kernels:
            monkeypatch.setattr(native, "kernels", lambda: None)
        for d_in, d_out in [(32, 96), (96, 32)]:  # both forms: (X^T G)^T and G^T X
            torch.manual_seed(d_in)
            x = torch.randn(5, 16, d_in)
            w = torch.randn(d_out, d_in, requires_grad=True)
            b = torch.randn(d_out, requires_grad=True)
            kernel(x, w, b).pow(2).sum().backward()
            grads.append(w.grad)
    for with_kernels, without in zip(grads[:2], grads[2:]):
        torch.testing.assert_close(with_kernels, without, rtol=0, atol=0)


def test_build_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("ATTNLAB_NATIVE", "0")
    module, reason = native._build.__wrapped__()
    assert module is None and "ATTNLAB_NATIVE=0" in reason


# ---- short_attention: softmax(scale Q K^T) V and its backward, against float64 ----------------


def _reference_attention(q, k, v, causal, scale):  # noqa: ANN001, ANN202
    """Eq. 1 in float64, causal bottom-right aligned as in attnlab.nn.attention."""
    scores = (q @ k.transpose(-2, -1)) * scale
    if causal:
        t_q, t_k = q.shape[-2], k.shape[-2]
        scores = scores.masked_fill(~torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q), float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _check_short_attention(q, k, v, causal, scale=None, grad=None):  # noqa: ANN001, ANN202
    """Output and gradients of the kernel on float32 inputs against float64 on the same values."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    leaves64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    reference = _reference_attention(*leaves64, causal, scale)
    grad = torch.randn(reference.shape, dtype=torch.float64) if grad is None else grad
    expected = torch.autograd.grad(reference, leaves64, grad)
    leaves = [t.detach().requires_grad_() if t.is_leaf else t for t in (q, k, v)]
    out = native.short_attention(*leaves, causal=causal, scale=scale)
    got = torch.autograd.grad(out, leaves, grad.float())
    for name, value, ref in zip(("output", "dQ", "dK", "dV"), (out, *got), (reference, *expected)):
        assert value.dtype == torch.float32 and value.shape == ref.shape, name
        torch.testing.assert_close(
            value.double(), ref, rtol=2e-5, atol=2e-5 * max(1.0, ref.abs().max().item()), msg=name
        )
    return out


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    ("t_q", "t_k", "d_k", "d_v"),
    [
        (64, 64, 32, 32),
        (5, 7, 8, 6),
        (2, 2, 1, 1),
        (16, 16, 16, 16),
        (33, 200, 40, 17),
        (64, 256, 64, 64),
        (100, 100, 64, 64),
        (17, 17, 96, 48),
        (256, 256, 64, 64),  # causal: whole blocks of keys and queries skipped
        (70, 250, 16, 24),
    ],
)
def test_short_attention_matches_float64(t_q, t_k, d_k, d_v, causal):
    if causal and t_k < t_q:
        pytest.skip("causal needs T_k >= T_q")
    q, k, v = torch.randn(3, 2, t_q, d_k), torch.randn(3, 2, t_k, d_k), torch.randn(3, 2, t_k, d_v)
    _check_short_attention(q, k, v, causal)


def test_short_attention_non_causal_takes_more_queries_than_keys():
    _check_short_attention(torch.randn(2, 2, 40, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8), False)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    t_q=st.integers(1, 70),
    extra_keys=st.integers(0, 40),
    d_k=st.integers(1, 70),
    d_v=st.integers(1, 70),
    causal=st.booleans(),
    scale=st.floats(0.01, 2.0),
)
def test_short_attention_property(batch, heads, t_q, extra_keys, d_k, d_v, causal, scale):
    t_k = t_q + extra_keys
    q, k, v = (
        torch.randn(batch, heads, t_q, d_k),
        torch.randn(batch, heads, t_k, d_k),
        torch.randn(batch, heads, t_k, d_v),
    )
    _check_short_attention(q, k, v, causal, scale=scale)


@pytest.mark.parametrize("causal", [False, True])
def test_short_attention_reads_heads_of_a_fused_projection(causal):
    """q, k, v as MultiHeadAttention hands them over: strided views of one (B, T, 3 H d) tensor.
    The output is laid out (B, T, H, d_v), so the heads' concatenation needs no copy; a gradient
    that is not contiguous in d is accepted."""
    b, h, t, d = 4, 3, 20, 16
    fused = torch.randn(b, t, 3 * h * d, requires_grad=True)
    q, k, v = (part.view(b, t, h, d).transpose(1, 2) for part in fused.split(h * d, dim=-1))
    out = _check_short_attention(q, k, v, causal)
    assert out.transpose(1, 2).is_contiguous()
    grad = torch.randn(b, h, d, t).transpose(-2, -1)  # stride 1 along T, not d
    reference = _reference_attention(q.double(), k.double(), v.double(), causal, d**-0.5)
    expected = torch.autograd.grad(reference, fused, grad.double())
    got = torch.autograd.grad(native.short_attention(q, k, v, causal=causal, scale=d**-0.5), fused, grad)
    torch.testing.assert_close(got[0], expected[0], rtol=2e-5, atol=2e-5)


def test_short_attention_is_stable_for_large_scores():
    """Scores of +-1000 would overflow exp() without the running maximum: no inf, no NaN."""
    q, k, v = torch.randn(2, 2, 8, 4) * 40, torch.randn(2, 2, 9, 4) * 40, torch.randn(2, 2, 9, 4)
    out = _check_short_attention(q, k, v, False, scale=1.0)
    assert torch.isfinite(out).all()


def test_short_attention_keys_permute_with_their_values():
    q, k, v = torch.randn(2, 2, 6, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)
    order = torch.randperm(11)
    torch.testing.assert_close(
        native.short_attention(q, k, v, causal=False, scale=0.3),
        native.short_attention(q, k[:, :, order], v[:, :, order], causal=False, scale=0.3),
        rtol=1e-6,
        atol=1e-6,
    )


def test_short_attention_causal_query_ignores_later_keys():
    q, k, v = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    changed_k, changed_v = k.clone(), v.clone()
    changed_k[:, :, 6:], changed_v[:, :, 6:] = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    before = native.short_attention(q, k, v, causal=True, scale=0.3)
    after = native.short_attention(q, changed_k, changed_v, causal=True, scale=0.3)
    assert torch.equal(before[:, :, :6], after[:, :, :6]) and not torch.equal(before[:, :, 6:], after[:, :, 6:])


def test_short_attention_rejects_what_it_cannot_run():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        native.short_attention(q.double(), q.double(), q.double(), causal=False, scale=1.0)
    with pytest.raises(RuntimeError, match="at most 256 keys"):
        long = torch.randn(1, 1, 257, 8)
        native.short_attention(q, long, long, causal=False, scale=1.0)
    with pytest.raises(RuntimeError, match="head widths up to 256"):
        wide = torch.randn(1, 1, 4, 257)
        native.short_attention(wide, wide, wide, causal=False, scale=1.0)
    with pytest.raises(RuntimeError, match="causal needs T_k >= T_q"):
        native.short_attention(torch.randn(1, 1, 5, 8), q, q, causal=True, scale=1.0)
    edge = torch.randn(1, 1, 3, native.SHORT_ATTENTION_MAX_HEAD_DIM)  # the limits themselves run
    long = torch.randn(1, 1, native.SHORT_ATTENTION_MAX_KEYS, native.SHORT_ATTENTION_MAX_HEAD_DIM)
    _check_short_attention(edge, long, long, False)


def test_short_attention_has_no_second_derivative():
    q, k, v = (torch.randn(1, 2, 4, 8, requires_grad=True) for _ in range(3))
    (grad_q,) = torch.autograd.grad(
        native.short_attention(q, k, v, causal=False, scale=0.3).sum(), q, create_graph=True
    )
    with pytest.raises(RuntimeError, match="no second derivative"):
        grad_q.sum().backward()
    first = native.short_attention(q, k, v, causal=False, scale=0.3).sum()
    torch.testing.assert_close(grad_q, torch.autograd.grad(first, q)[0])  # the first derivative is unchanged


@pytest.mark.parametrize(
    ("case", "native_kernel"),
    [
        ("plain", True),
        ("causal", True),
        ("mask", False),
        ("dropout", False),
        ("float64", False),
        ("long", False),
        ("many queries", False),
        ("one query", False),
        ("3-d", False),
    ],
)
def test_attention_runs_the_kernel_where_it_applies(case, native_kernel, monkeypatch):
    """attnlab.nn.attention takes the kernel for float32 (B, H, T, d) heads, 2-256 queries over at
    most 256 keys, without a mask or dropout, and PyTorch's fused kernel otherwise; both give the
    same output."""
    import importlib

    attention_module = importlib.import_module("attnlab.nn.attention")
    calls = []
    real = kernels.short_attention
    monkeypatch.setattr(kernels, "short_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t_k = 300 if case == "long" else 12
    t_q = {"one query": 1, "many queries": 300}.get(case, 12)
    dtype = torch.float64 if case == "float64" else torch.float32
    shape = (2, 3) if case != "3-d" else (6,)
    q = torch.randn(*shape, t_q, 8, dtype=dtype)
    k, v = torch.randn(*shape, t_k, 8, dtype=dtype), torch.randn(*shape, t_k, 8, dtype=dtype)
    kwargs = {"causal": case == "causal", "dropout_p": 0.1 if case == "dropout" else 0.0}
    mask = torch.rand(t_q, t_k) < 0.8 if case == "mask" else None
    if mask is not None:
        mask[:, 0] = True
    torch.manual_seed(0)
    out = attention_module.attention(q, k, v, mask, **kwargs)
    assert bool(calls) == native_kernel
    if case != "dropout":
        reference = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kwargs["causal"])
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_short_attention_traces_under_torch_compile(causal):
    """The operators have fake kernels, so torch.compile traces through them (forward and
    backward, AOT autograd), with the eager kernel's results."""
    q, k, v = (torch.randn(2, 3, 20, 16, requires_grad=True) for _ in range(3))
    compiled = torch.compile(
        lambda q, k, v: native.short_attention(q, k, v, causal=causal, scale=0.25).square().sum(),
        backend="aot_eager",
        fullgraph=True,
    )
    got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    expected = torch.autograd.grad(native.short_attention(q, k, v, causal=causal, scale=0.25).square().sum(), (q, k, v))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


_OTHER_ISA_CHECK = """
import torch
from attnlab import kernels
from attnlab.kernels import native
from attnlab.kernels.dropout_masks import signed_threshold
assert native.kernels() is not None, native.unavailable_reason()
assert native.kernels().__name__ == native.build_spec().name
assert native.build_spec().name.startswith("attnlab_native_" + torch.backends.cpu.get_cpu_capability().lower() + "_")
q, k, v = torch.randn(3, 2, 37, 40), torch.randn(3, 2, 45, 40), torch.randn(3, 2, 45, 24)
for causal in (False, True):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = native.short_attention(*leaves, causal=causal, scale=0.2)
    out.square().sum().backward()
    ref_leaves = [t.double().requires_grad_() for t in (q, k, v)]
    scores = ref_leaves[0] @ ref_leaves[1].transpose(-2, -1) * 0.2
    if causal:
        scores = scores.masked_fill(~torch.ones(37, 45, dtype=torch.bool).tril(8), float("-inf"))
    ref = torch.softmax(scores, -1) @ ref_leaves[2]
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=2e-5, atol=1e-4)
x, w, b = torch.randn(3, 70), torch.randn(33, 70), torch.randn(33)
expected = x.double() @ w.double().T + b.double()
torch.testing.assert_close(native.few_rows_linear(x, w, b).double(), expected, rtol=1e-5, atol=1e-5)
q, k, v = torch.randn(2, 3, 2, 40), torch.randn(2, 3, 9, 40), torch.randn(2, 3, 9, 24)
weights = torch.softmax((q.double() @ k.double().transpose(-1, -2)) * 0.3, -1)
expected = weights @ v.double()
out = native.decode_attention(q, k, v, None, causal=False, scale=0.3).double()
torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
x, angles = torch.randn(2, 3, 5, 38), torch.randn(1, 1, 5, 38)
rotated = native.rotary(x, angles.cos(), angles.sin()).double()
first, second = x.double().chunk(2, -1)
expected = x.double() * angles.cos().double() + torch.cat((-second, first), -1) * angles.sin().double()
torch.testing.assert_close(rotated, expected, rtol=1e-5, atol=1e-6)
h = torch.randn(5, 2 * 37) * 6
g, u = h.double().chunk(2, -1)
torch.testing.assert_close(native.swiglu(h).double(), torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
mask = native.scaled_keep_mask((1000,), seed=7, bits=16, threshold=signed_threshold(0.1), scale=1 / 0.9)
print("ok", float(mask.sum()))
"""


@pytest.mark.slow
@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_kernels_built_for_other_vector_widths_give_the_same_results(capability):
    """The kernels are compiled for the capability PyTorch runs with; ATEN_CPU_CAPABILITY lowers it,
    so the AVX2 build and the compiler's default build (the same GCC vector code on narrower
    registers) are checked on this machine too, each in a process of its own."""
    import os
    import subprocess
    import sys

    if torch.backends.cpu.get_cpu_capability() == "DEFAULT" and capability != "default":
        pytest.skip("this CPU has no AVX2")
    run = subprocess.run(
        [sys.executable, "-c", _OTHER_ISA_CHECK],
        env={**os.environ, "ATEN_CPU_CAPABILITY": capability},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    words = np.random.PCG64(7).random_raw(250).view(np.int16)  # the same mask as the NumPy path
    expected = (words >= signed_threshold(0.1)).sum() / 0.9
    assert float(run.stdout.split()[-1]) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9])  # passes of up to 4 rows over W, and a short last one
@pytest.mark.parametrize("d_in,d_out", [(576, 1536), (64, 3), (70, 33), (1, 7), (15, 300)])  # tails of 16 and 64
@pytest.mark.parametrize("with_bias", [True, False])
def test_few_rows_linear_matches_float64(rows, d_in, d_out, with_bias):
    g = torch.Generator().manual_seed(rows * 1000 + d_in)
    x, weight = torch.randn(rows, d_in, generator=g), torch.randn(d_out, d_in, generator=g)
    bias = torch.randn(d_out, generator=g) if with_bias else None
    out = native.few_rows_linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (rows, d_out) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * d_in**0.5)


@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize("d_in,d_out", [(576, 1536), (70, 33), (15, 300)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_few_rows_linear_in_bfloat16_is_the_float32_sum_rounded_once(rows, d_in, d_out, with_bias):
    """bfloat16 weights and inputs are widened exactly; the float32 sum is rounded to bfloat16 at
    the end: within one bfloat16 rounding of the float64 product of the same bf16 values, and
    the same bits at one and two threads."""
    g = torch.Generator().manual_seed(rows * 100 + d_in)
    x, weight = torch.randn(rows, d_in, generator=g).bfloat16(), torch.randn(d_out, d_in, generator=g).bfloat16()
    bias = torch.randn(d_out, generator=g).bfloat16() if with_bias else None
    out = native.few_rows_linear(x, weight, bias)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert out.shape == (rows, d_out) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=2**-8, atol=1e-5 * d_in**0.5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.few_rows_linear(x, weight, bias), out)
    finally:
        torch.set_num_threads(before)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    d_in=st.integers(1, 200),
    d_out=st.integers(1, 300),
    lead=st.sampled_from([(), (2,), (1, 3)]),
    threads=st.sampled_from([1, 2]),
)
def test_few_rows_linear_property(rows, d_in, d_out, lead, threads):
    """Any shape, leading dims kept; each output is summed in an order fixed by d_in, so one and
    two threads give the same bits."""
    g = torch.Generator().manual_seed(d_in * 1000 + d_out)
    x, weight, bias = torch.randn(*lead, rows, d_in, generator=g), torch.randn(d_out, d_in, generator=g), None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        out = native.few_rows_linear(x, weight, bias)
        torch.set_num_threads(3 - threads)
        again = native.few_rows_linear(x, weight, bias)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (*lead, rows, d_out)
    assert torch.equal(out, again)
    torch.testing.assert_close(out.double(), x.double() @ weight.double().T, rtol=0, atol=1e-5 * d_in**0.5)


def test_few_rows_linear_reads_strided_rows_and_rejects_what_it_cannot_run():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, 3, generator=g).transpose(1, 2)[:, :1]  # (2, 1, 64), not unit stride in d_in
    weight = torch.randn(40, 64, generator=g)
    torch.testing.assert_close(native.few_rows_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 CPU"):
        native.few_rows_linear(x.double(), weight.double(), None)
    with pytest.raises(RuntimeError, match="x of W's dtype"):
        native.few_rows_linear(x, weight.bfloat16(), None)
    with pytest.raises(RuntimeError, match="contiguous weight"):
        native.few_rows_linear(x, torch.randn(64, 40).T, None)
    with pytest.raises(RuntimeError, match="x \\(M, K\\) and weight \\(N, K\\)"):
        native.few_rows_linear(x, torch.randn(40, 63), None)


@pytest.mark.parametrize("grad", [False, True])
def test_onednn_linear_takes_the_native_kernel_for_few_rows_without_gradients(monkeypatch, grad):
    """A decoding step's few rows go to the native kernel; where a gradient is wanted, F.linear."""
    calls = []
    real = native.few_rows_linear
    monkeypatch.setattr(native, "few_rows_linear", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 48, generator=g, requires_grad=grad)
    weight, bias = torch.randn(20, 48, generator=g), torch.randn(20, generator=g)
    out = linear_module.OneDNNLinear()(x, weight, bias)
    assert bool(calls) is not grad and out.requires_grad is grad
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    calls.clear()
    linear_module.OneDNNLinear()(x.detach(), torch.randn(20, 96, generator=g)[:, :48], bias)  # not contiguous
    assert not calls


def _decode_attention_float64(q, k, v, mask, causal, scale):
    """The explicit formula in float64: forbidden keys weigh 0, a row with no allowed key is 0."""
    t_q, t_k = q.shape[-2], k.shape[-2]
    allowed = torch.ones(t_q, t_k, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(t_k - t_q)
    if mask is not None:
        allowed = allowed & mask
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    has_key = allowed.any(-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~has_key, 0.0), -1) * has_key
    return weights @ v.double()


@pytest.mark.parametrize("t_q,t_k", [(1, 1), (1, 70), (3, 300), (16, 20), (4, 3)])
@pytest.mark.parametrize("d_k,d_v", [(32, 32), (64, 64), (16, 16), (20, 36), (1, 7)])  # unrolled and general paths
@pytest.mark.parametrize("causal", [False, True])
def test_decode_attention_matches_float64(t_q, t_k, d_k, d_v, causal):
    g = torch.Generator().manual_seed(t_q * 1000 + t_k + d_k)
    q, k, v = (torch.randn(2, 3, t, d, generator=g) for t, d in ((t_q, d_k), (t_k, d_k), (t_k, d_v)))
    out = native.decode_attention(q, k, v, None, causal=causal, scale=d_k**-0.5)
    assert out.shape == (2, 3, t_q, d_v)
    expected = _decode_attention_float64(q, k, v, None, causal, d_k**-0.5)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(2, 1, 1, 12), (2, 3, 4, 12), (1, 1, 4, 12), (12,)])  # broadcast to (B, H, T_q, T_k)
def test_decode_attention_masks_and_empty_rows(shape):
    """Forbidden keys weigh 0; a query with no allowed key gets zeros (the explicit formula's answer)."""
    g = torch.Generator().manual_seed(len(shape))
    q, k = torch.randn(2, 3, 4, 32, generator=g), torch.randn(2, 3, 12, 32, generator=g)
    v = torch.randn(2, 3, 12, 32, generator=g)
    mask = torch.rand(shape, generator=g) > 0.4
    mask.view(-1)[:12] = False  # the first row (or the whole mask, when it has one row) sees nothing
    out = native.decode_attention(q, k, v, mask, causal=False, scale=0.2)
    expected = _decode_attention_float64(q, k, v, mask, False, 0.2)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert (out[0, 0, 0] == 0).all()


def test_decode_attention_reads_a_cache_view_and_lays_heads_side_by_side():
    """Keys and values as views into a longer preallocated cache; the output's heads concatenate as a view."""
    cache = torch.randn(2, 4, 50, 64)
    q, k, v = torch.randn(2, 4, 1, 64), cache[:, :, :17], cache.flip(2)[:, :, :17].contiguous()
    out = native.decode_attention(q, k, v, None, causal=True, scale=0.125)
    torch.testing.assert_close(
        out.double(), _decode_attention_float64(q, k, v, None, True, 0.125), rtol=1e-5, atol=1e-5
    )
    assert out.transpose(1, 2).is_contiguous()  # (B, T_q, H, d_v)


@settings(max_examples=30, deadline=None)
@given(
    t_q=st.integers(1, 16), t_k=st.integers(1, 90), d=st.sampled_from([8, 16, 32, 48, 64, 100]), causal=st.booleans()
)
def test_decode_attention_property(t_q, t_k, d, causal):
    g = torch.Generator().manual_seed(t_q * 100 + t_k)
    q, k = torch.randn(1, 2, t_q, d, generator=g), torch.randn(1, 2, t_k, d, generator=g) * 3
    v = torch.randn(1, 2, t_k, d, generator=g)
    out = native.decode_attention(q, k, v, None, causal=causal, scale=d**-0.5)
    expected = _decode_attention_float64(q, k, v, None, causal, d**-0.5)
    # float32 sums of up to 90 weighted values: a few ulps of the largest value, not of each entry
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_decode_attention_rejects_what_it_cannot_run():
    q = torch.randn(1, 1, 1, 8)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        native.decode_attention(q.double(), q.double(), q.double(), None, causal=False, scale=1.0)
    with pytest.raises(RuntimeError, match="head widths up to 256"):
        wide = torch.randn(1, 1, 1, 257)
        native.decode_attention(wide, wide, wide, None, causal=False, scale=1.0)
    with pytest.raises(RuntimeError, match="disagree"):
        native.decode_attention(q, torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), None, causal=False, scale=1.0)


@pytest.mark.parametrize("case", ["decoding", "grad", "weights", "prompt", "bias"])
def test_attention_takes_the_decode_kernel_only_for_a_decoding_step(monkeypatch, case):
    """attnlab.nn.attention: a few queries without gradients, weights or a score bias go to the
    kernel, with the explicit formula's result; anything else keeps its own path."""
    from attnlab.nn.attention import attention

    calls = []
    real = kernels.decode_attention
    monkeypatch.setattr(kernels, "decode_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(5)
    t_q = 40 if case == "prompt" else 2
    q = torch.randn(2, 4, t_q, 32, generator=g, requires_grad=case == "grad")
    k, v = torch.randn(2, 4, 40, 32, generator=g), torch.randn(2, 4, 40, 32, generator=g)
    mask = torch.rand(2, 1, 1, 40, generator=g) > 0.3
    bias = torch.randn(4, t_q, 40, generator=g) if case == "bias" else None
    result = attention(q, k, v, mask=mask, causal=True, return_weights=case == "weights", bias=bias)
    out = result[0] if case == "weights" else result
    assert bool(calls) is (case == "decoding")
    expected = _decode_attention_float64(q.detach(), k, v, mask, True, 32**-0.5)
    if bias is None:
        torch.testing.assert_close(out.detach().double(), expected, rtol=1e-5, atol=1e-5)


def _rotary_float64(x, cos, sin):
    first, second = x.double().chunk(2, dim=-1)
    return x.double() * cos.double() + torch.cat((-second, first), dim=-1) * sin.double()


@pytest.mark.parametrize("d", [2, 8, 30, 32, 64, 128])  # vector tails of the half width, and exact multiples
@pytest.mark.parametrize("angle_batch", [1, 2])
def test_rotary_matches_float64_on_strided_heads(d, angle_batch):
    """Heads as the fused projection's strided view, angles per batch row or shared."""
    from attnlab.nn.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(d)
    fused = torch.randn(2, 7, 3, 4, d, generator=g)  # (B, T, q|k|v, H, d)
    x = fused[:, :, 1].transpose(1, 2)  # (B, H, T, d), not contiguous
    positions = torch.randint(0, 500, (angle_batch, 7), generator=g)
    cos, sin = RotaryEmbedding(d, 10000.0)._angles(positions)
    out = native.rotary(x, cos, sin)
    assert out.shape == x.shape and out.is_contiguous()
    torch.testing.assert_close(out.double(), _rotary_float64(x, cos, sin), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True])
def test_rotary_embedding_takes_the_kernel_only_without_gradients(monkeypatch, grad):
    import importlib

    rotary_module = importlib.import_module("attnlab.nn.rotary")
    calls = []
    monkeypatch.setattr(rotary_module, "fused_rotary", lambda *a: calls.append(1) or native.rotary(*a))
    rope = rotary_module.RotaryEmbedding(16, 100.0)
    q, k = torch.randn(2, 6, 5, 16, requires_grad=grad), torch.randn(2, 2, 5, 16, requires_grad=grad)
    positions = torch.tensor([[0, 1, 2, 3, 4], [0, 0, 1, 2, 3]])
    rq, rk = rope(q, k, positions)
    assert bool(calls) is not grad
    cos, sin = rope._angles(positions)
    torch.testing.assert_close(rq.detach().double(), _rotary_float64(q.detach(), cos, sin), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(rk.detach().double(), _rotary_float64(k.detach(), cos, sin), rtol=1e-6, atol=1e-6)


def _swiglu_float64(hidden):
    gate, up = hidden.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("width", [1, 15, 16, 17, 1536])  # vector tails and SmolLM2's d_ff
def test_swiglu_matches_float64_at_every_scale(width):
    g = torch.Generator().manual_seed(width)
    hidden = torch.randn(7, 2 * width, generator=g) * 8
    hidden[0, :width] = torch.linspace(-120, 120, width)  # saturating gates both ways, 0 in the middle
    out = native.swiglu(hidden)
    assert out.shape == (7, width) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _swiglu_float64(hidden), rtol=2e-6, atol=1e-30)


def test_swiglu_special_values():
    """SiLU(0) = 0, SiLU(-inf-ish) -> -0, SiLU(large) = the gate itself; NaN stays NaN."""
    gate = torch.tensor([0.0, -0.0, 200.0, -200.0, 88.5, -88.5, float("nan"), 1e-30])
    out = native.swiglu(torch.cat([gate, torch.full_like(gate, 2.0)]).view(1, -1))[0]
    assert out[0] == 0 and out[1] == 0 and out[3] == 0 and out[5].abs() < 1e-30
    assert out[2] == 400.0 and out[4] == 177.0
    assert out[6].isnan() and out[7] == pytest.approx(1e-30, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(lead=st.sampled_from([(1,), (3,), (2, 5)]), width=st.integers(1, 100), scale=st.sampled_from([0.1, 3.0, 50.0]))
def test_swiglu_property(lead, width, scale):
    hidden = torch.randn(*lead, 2 * width, generator=torch.Generator().manual_seed(width)) * scale
    out = native.swiglu(hidden)
    assert out.shape == (*lead, width)
    torch.testing.assert_close(out.double(), _swiglu_float64(hidden), rtol=2e-6, atol=1e-30)


def test_swiglu_reads_strided_rows():
    hidden = torch.randn(4, 3, 64).transpose(0, 1)  # (3, 4, 64): rows not contiguous with each other
    torch.testing.assert_close(native.swiglu(hidden).double(), _swiglu_float64(hidden), rtol=2e-6, atol=1e-30)
    with pytest.raises(RuntimeError, match="float32 CPU"):
        native.swiglu(hidden.double())


@pytest.mark.parametrize("grad", [False, True])
def test_the_ffn_takes_the_fused_swiglu_only_without_gradients(monkeypatch, grad):
    """A SwiGLU FFN gives the same output either way; training (a gradient) takes PyTorch's ops."""
    import attnlab.nn.feed_forward as feed_forward

    calls = []
    monkeypatch.setattr(feed_forward, "fused_swiglu", lambda h: calls.append(1) or native.swiglu(h))
    ffn = feed_forward.PositionwiseFeedForward(24, 40, activation="swiglu", bias=False).requires_grad_(grad)
    x = torch.randn(2, 5, 24, requires_grad=grad)
    out = ffn(x)
    assert bool(calls) is not grad
    first, second = ffn.linear1.weight.double(), ffn.linear2.weight.double()
    expected = _swiglu_float64(x.double() @ first.T) @ second.T
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if grad:
        out.sum().backward()
        assert x.grad is not None and ffn.linear1.weight.grad is not None


def test_available_is_marked_as_torch_compiler_marks_a_constant_result():
    """native.available() is marked for torch.compile by hand (torch.compiler's decorator imports
    torch._dynamo at start-up): the mark must be the one the decorator sets, and importing the
    kernels must not import torch._dynamo."""
    import subprocess
    import sys

    marked = torch.compiler.assume_constant_result(lambda: True)
    assert {k: v for k, v in vars(marked).items()} == {k: v for k, v in vars(native.available).items()}
    code = "import sys, attnlab.kernels.native; print('torch._dynamo' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
        == "False"
    )
