"""Soft attention in float16/bfloat16: scores and softmax in float32, the input dtype out.

Inputs of std 100 score beyond float16's range (q . k reaches 65504 at d_k = 16); every soft path
(fused, explicit, decoding step, additive score, the soft backward of straight-through hard
attention, multi-head attention) must give finite outputs and gradients close to float64's.
"""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn.attention import attention
from attnlab.nn.multi_head import MultiHeadAttention
from attnlab.nn.scores import AdditiveScore
from tests.unit.nn.attending import attend

HALF = [torch.float16, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
EPS = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # unit roundoff of the output's dtype


def _qkv(dtype, *, batch=2, heads=3, t_q=5, t_k=7, d=16, std=100.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(batch, heads, t_q, d), (batch, heads, t_k, d), (batch, heads, t_k, d)]
    return [(torch.randn(*s, generator=g, dtype=torch.float64) * std).to(dtype) for s in shapes]


def _reference(q, k, v, mask=None, *, causal=False, score_fn=None):
    """Eq. 1 in float64 from the (already rounded) inputs; a row with no key gives 0."""
    q, k, v = q.double(), k.double(), v.double()
    scores = score_fn(q, k) if score_fn is not None else q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    allowed = torch.ones(scores.shape, dtype=torch.bool) if mask is None else mask.expand(scores.shape)
    if causal:
        t_q, t_k = scores.shape[-2:]
        allowed = allowed & torch.ones(t_q, t_k, dtype=torch.bool).tril(t_k - t_q)
    weights = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1).nan_to_num(0.0)
    return weights @ v


def _hard_reference(q, k, v):
    """Hard attention in float64: the value at each query's argmax score."""
    index = (q.double() @ k.double().transpose(-2, -1)).argmax(-1, keepdim=True)  # (..., T_q, 1)
    return torch.gather(v.double(), -2, index.expand(*index.shape[:-1], v.shape[-1]))


def _outputs_and_grads(fn, inputs, upstream):
    inputs = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*inputs)
    (out.double() * upstream).sum().backward()
    return out, [t.grad for t in inputs]


def _assert_close_to_float64(fn, reference_fn, inputs, dtype, tol=8.0, device="cpu"):
    """Outputs and gradients finite, in ``dtype``, and within ``tol`` unit roundoffs of float64's,
    each relative to its tensor's scale: max |value| for the output (a convex combination of the
    values); for a gradient the larger of its own max and, for q and k, the bound of what rounding
    the output can move it by (scale x max|g| x max|v| x max|k or q|). At std 100 the softmax is
    one-hot in float64 and the q, k gradients are 0 there; only rounding moves them."""
    g = torch.Generator().manual_seed(1)
    upstream = torch.randn(reference_fn(*inputs).shape, generator=g, dtype=torch.float64)
    out, grads = _outputs_and_grads(fn, [t.to(device) for t in inputs], upstream.to(device))
    out, grads = out.cpu(), [grad.cpu() for grad in grads]
    ref_out, ref_grads = _outputs_and_grads(reference_fn, [t.double() for t in inputs], upstream)
    q, k, v = (t.double().abs().max().item() for t in inputs)
    rounding = upstream.abs().max().item() * v / math.sqrt(inputs[0].shape[-1])
    scales = [v, rounding * k, rounding * q, 0.0]  # output, dq, dk, dv
    assert out.dtype == dtype
    for got, expected, scale in zip([out, *grads], [ref_out, *ref_grads], scales):
        assert got.dtype == dtype
        assert torch.isfinite(got).all(), f"{int((~torch.isfinite(got)).sum())} NaN/Inf of {got.numel()}"
        scale = max(scale, expected.abs().max().item())
        torch.testing.assert_close(got.double(), expected, rtol=0.0, atol=tol * EPS[dtype] * scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("std", [1.0, 100.0])
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(
    "case",
    ["fused", "fused_causal", "fused_mask", "weights", "weights_mask", "decoding_step", "straight_through"],
)
def test_half_precision_is_finite_and_close_to_float64(dtype, case, std, device):
    t_q = 1 if case == "decoding_step" else 5
    batch = 64 if case == "decoding_step" else 2  # 192 (batch x head) rows: the explicit decoding path
    inputs = _qkv(dtype, batch=batch, t_q=t_q, std=std)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) < 0.6 if "mask" in case else None
    causal = case == "fused_causal"
    on_device = None if mask is None else mask.to(device)
    if case == "straight_through":

        def fn(q, k, v):  # forward: hard attention; backward: soft attention's gradient
            return attention(q, k, v, normalizer="hardmax", straight_through=True)

        def reference_fn(q, k, v):
            soft = _reference(q, k, v)
            return soft + (_hard_reference(q, k, v) - soft).detach()
    else:
        weights = case.startswith("weights")  # the explicit path, which also returns the weights

        def fn(q, k, v):
            result = attention(q, k, v, on_device, causal=causal, return_weights=weights)
            return result[0] if weights else result

        def reference_fn(q, k, v):
            return _reference(q, k, v, mask, causal=causal)

    _assert_close_to_float64(fn, reference_fn, inputs, dtype, device=device)


@pytest.mark.parametrize("std", [1.0, 100.0])
@pytest.mark.parametrize("dtype", HALF)
def test_additive_scores_in_half_precision(dtype, std):
    score = AdditiveScore(heads=3, d_k=16).to(dtype)
    inputs = _qkv(dtype, std=std)

    def fn(q, k, v):
        return attention(q, k, v, score_fn=score.score_fn)

    def reference_fn(q, k, v):
        return _reference(q, k, v, score_fn=score.score_fn)

    _assert_close_to_float64(fn, reference_fn, inputs, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_weights_are_returned_in_the_input_dtype_and_sum_to_one(dtype):
    q, k, v = _qkv(dtype)
    out, weights = attention(q, k, v, return_weights=True)
    assert out.dtype == weights.dtype == dtype
    assert torch.isfinite(weights).all()
    torch.testing.assert_close(
        weights.double().sum(-1), torch.ones(weights.shape[:-1], dtype=torch.float64), rtol=0, atol=8 * EPS[dtype]
    )


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("score", ["scaled_dot", "additive"])
def test_multi_head_attention_in_half_precision_with_large_inputs(dtype, score):
    torch.manual_seed(0)
    mha = MultiHeadAttention(32, 2, score=score)
    x = torch.randn(2, 6, 32, dtype=torch.float64) * 100
    for need_weights in (False, True):
        half = MultiHeadAttention(32, 2, score=score).to(dtype)
        half.load_state_dict(mha.state_dict())
        xh = x.to(dtype).requires_grad_()
        output = attend(half, xh, causal=True).output if need_weights else half(xh, causal=True)
        output.float().sum().backward()
        assert output.dtype == dtype and torch.isfinite(output).all()
        assert torch.isfinite(xh.grad).all()
        assert all(torch.isfinite(p.grad).all() for p in half.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("masked", [False, True])
def test_float32_and_float64_explicit_path_is_unchanged(dtype, masked):
    """The explicit path in float32/float64 is the formula it always was, bit for bit."""
    q, k, v = _qkv(dtype, std=1.0)
    mask = torch.rand(5, 7, generator=torch.Generator().manual_seed(2)) < 0.6 if masked else None
    out, weights = attention(q, k, v, mask, return_weights=True)
    scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(16))
    if mask is not None:
        scores = scores.masked_fill(~mask, torch.finfo(dtype).min)
    expected_weights = torch.softmax(scores, dim=-1, dtype=dtype)
    if mask is not None:
        expected_weights = expected_weights * mask
    assert out.dtype == weights.dtype == dtype
    assert torch.equal(weights, expected_weights)
    assert torch.equal(out, torch.matmul(expected_weights, v))
