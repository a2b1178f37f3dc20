"""Hypothesis property tests: random shapes, masks, dtypes and options, against float64 references.

No NaN or Inf anywhere (empty rows included), and agreement with the float64 formula within a
tolerance set by the dtype. For hard attention in low precision, rows whose two best scores are
closer than rounding can separate are not compared (their argmax is legitimately ambiguous).
"""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.nn import MultiHeadAttention
from attnlab.nn.attention import attention
from attnlab.nn.masks import causal_mask
from attnlab.nn.scores import SCORES
from tests import reference
from tests.unit.nn.attending import masked

DTYPES = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-2,
    torch.bfloat16: 1e-1,
}
TIE_MARGIN = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 0.05, torch.bfloat16: 0.3}
PROPERTY_SETTINGS = settings(
    max_examples=250, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def attention_cases(draw):
    dims = {
        "b": draw(st.integers(1, 3)),
        "h": draw(st.integers(1, 3)),
        "t_q": draw(st.integers(1, 9)),
        "t_k": draw(st.integers(1, 9)),
        "d": draw(st.integers(1, 8)),
        "d_v": draw(st.integers(1, 8)),
    }
    mask_kind = draw(st.sampled_from(["none", "random", "padding", "empty"]))
    return {
        **dims,
        "dtype": draw(st.sampled_from(list(DTYPES))),
        "normalizer": draw(st.sampled_from(["softmax", "hardmax"])),
        "mask_kind": mask_kind,
        "density": draw(st.floats(0.0, 1.0)),
        "causal": draw(st.booleans()) and dims["t_k"] >= dims["t_q"],
        "weights": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


def _mask(case, rng):
    b, h, t_q, t_k = case["b"], case["h"], case["t_q"], case["t_k"]
    if case["mask_kind"] == "none":
        return None
    if case["mask_kind"] == "random":
        return torch.from_numpy(rng.random((b, h, t_q, t_k)) < case["density"])
    if case["mask_kind"] == "padding":
        lengths = rng.integers(0, t_k + 1, size=b)
        return torch.from_numpy(np.arange(t_k)[None, :] < lengths[:, None])[:, None, None, :]
    return torch.zeros(b, 1, t_q, t_k, dtype=torch.bool)


def _comparable_rows(q, k, allowed, margin):
    """Rows whose best allowed score beats the runner-up by more than ``margin``, or with < 2 keys."""
    s = np.einsum("...qd,...kd->...qk", q, k) / np.sqrt(q.shape[-1])
    s = np.where(allowed, s, -np.inf)
    top2 = np.sort(s, axis=-1)[..., -2:] if s.shape[-1] > 1 else np.concatenate([np.full_like(s, -np.inf), s], -1)
    with np.errstate(invalid="ignore"):  # -inf - -inf on rows with no allowed key
        gap = top2[..., 1] - top2[..., 0]
    return ~np.isfinite(top2[..., 0]) | (gap > margin)


@PROPERTY_SETTINGS
@given(attention_cases())
def test_attention_matches_float64_reference(case):
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    shape = (case["b"], case["h"])
    q = torch.from_numpy(rng.standard_normal((*shape, case["t_q"], case["d"]))).to(dtype)
    k = torch.from_numpy(rng.standard_normal((*shape, case["t_k"], case["d"]))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((*shape, case["t_k"], case["d_v"]))).to(dtype)
    mask = _mask(case, rng)
    q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    result = attention(
        q,
        k,
        v,
        mask,
        normalizer=case["normalizer"],
        causal=case["causal"],
        return_weights=case["weights"],
        straight_through=case["normalizer"] == "hardmax",
    )
    out = result[0] if case["weights"] else result
    assert out.dtype == dtype and out.shape == (*shape, case["t_q"], case["d_v"])
    assert torch.isfinite(out).all()
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()

    allowed = np.ones((case["t_q"], case["t_k"]), bool) if mask is None else mask.numpy()
    if case["causal"]:
        allowed = allowed & causal_mask(case["t_q"], case["t_k"]).numpy()
    allowed = np.broadcast_to(allowed, (*shape, case["t_q"], case["t_k"]))
    q64, k64, v64 = (t.detach().double().numpy() for t in (q, k, v))
    ref_out, ref_w = reference.batched_attention(q64, k64, v64, allowed, normalizer=case["normalizer"])
    rows = np.ones(ref_out.shape[:-1], bool)
    if case["normalizer"] == "hardmax":
        rows = _comparable_rows(q64, k64, allowed, TIE_MARGIN[dtype])
    tol = DTYPES[dtype]
    np.testing.assert_allclose(out.detach().double().numpy()[rows], ref_out[rows], atol=tol * 4, rtol=tol)
    if case["weights"]:
        np.testing.assert_allclose(result[1].detach().double().numpy()[rows], ref_w[rows], atol=tol, rtol=tol)


@PROPERTY_SETTINGS
@given(
    score=st.sampled_from(sorted(SCORES)),
    normalizer=st.sampled_from(["softmax", "hardmax"]),
    heads=st.integers(1, 4),
    d_k=st.integers(1, 6),
    t_q=st.integers(1, 6),
    t_k=st.integers(1, 6),
    cross=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_multi_head_matches_float64_sum_of_heads(score, normalizer, heads, d_k, t_q, t_k, cross, seed):
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    d_model = 8
    mha = MultiHeadAttention(d_model, heads, d_k=d_k, score=score, normalizer=normalizer).double()
    x = torch.from_numpy(rng.standard_normal((1, t_q, d_model)))
    memory = torch.from_numpy(rng.standard_normal((1, t_k, d_model))) if cross else None
    t_k = t_k if cross else t_q
    allowed = torch.from_numpy(rng.random((t_q, t_k)) < 0.7)
    xi = torch.from_numpy(rng.random(heads))
    out = masked(mha, x, memory, mask=allowed, head_mask=xi)[0].detach().numpy()
    assert np.isfinite(out).all()
    expected = reference.multi_head(mha, x[0], None if memory is None else memory[0], allowed.numpy(), xi.numpy())
    np.testing.assert_allclose(out, expected, atol=1e-9)
