"""attnlab.nn.attention: Eq. 1 against SDPA and float64, hardmax ties, empty rows, dtypes."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from attnlab.nn import attention_backends
from attnlab.nn.attention import attention
from attnlab.nn.masks import causal_mask
from tests import reference

# the submodule, not the function `attnlab.nn.attention` that shadows it
attention_module = importlib.import_module("attnlab.nn.attention")


def _qkv(b=2, h=3, t_q=5, t_k=7, d=8, d_v=6, dtype=torch.float32):
    return (
        torch.randn(b, h, t_q, d, dtype=dtype),
        torch.randn(b, h, t_k, d, dtype=dtype),
        torch.randn(b, h, t_k, d_v, dtype=dtype),
    )


def _random_mask(b, h, t_q, t_k, p=0.6, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(b, h, t_q, t_k, generator=g) < p


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "arbitrary"])
def test_soft_equals_sdpa(mask_kind):
    q, k, v = _qkv(t_q=6, t_k=6)
    mask = {
        "none": None,
        "causal": causal_mask(6),
        "padding": torch.tensor([[True] * 6, [True] * 4 + [False] * 2])[:, None, None, :],
        "arbitrary": _random_mask(2, 3, 6, 6) | torch.eye(6, dtype=torch.bool),
    }[mask_kind]
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(attention(q, k, v, mask), expected, atol=1e-6, rtol=1e-5)


def test_causal_flag_equals_causal_mask():
    q, k, v = _qkv(t_q=6, t_k=6)
    torch.testing.assert_close(attention(q, k, v, causal=True), attention(q, k, v, causal_mask(6)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
def test_causal_with_cache_alignment(normalizer):
    """T_k > T_q: the queries are the last T_q positions (decoding with a KV cache)."""
    q, k, v = _qkv(t_q=7, t_k=7)
    full = attention(q, k, v, causal=True, normalizer=normalizer)
    tail = attention(q[..., 4:, :], k, v, causal=True, normalizer=normalizer)
    torch.testing.assert_close(tail, full[..., 4:, :], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["none", "padding", "arbitrary", "causal"])
def test_weights_change_output_by_at_most_1e6(mask_kind):
    q, k, v = _qkv(t_q=9, t_k=9)
    mask = {
        "none": None,
        "padding": torch.tensor([[True] * 9, [True] * 3 + [False] * 6])[:, None, None, :],
        "arbitrary": _random_mask(2, 3, 9, 9),
        "causal": None,
    }[mask_kind]
    causal = mask_kind == "causal"
    fused = attention(q, k, v, mask, causal=causal)
    explicit, weights = attention(q, k, v, mask, causal=causal, return_weights=True)
    assert (fused - explicit).abs().max().item() <= 1e-6
    assert weights.shape == (2, 3, 9, 9)


# 2 x 3 and 48 x 3 (batch x head) rows: either side of where the explicit formula used to take over.
SINGLE_QUERY_BATCHES = [2, 48]


@pytest.mark.parametrize("batch", SINGLE_QUERY_BATCHES)
@pytest.mark.parametrize("mask_kind", ["none", "padding", "arbitrary", "empty_row"])
@pytest.mark.parametrize("causal", [False, True])
def test_single_query_equals_sdpa_and_float64_reference(batch, mask_kind, causal):
    """One query against a (strided) KV-cache view, as in a decoding step."""
    q, _, _ = _qkv(b=batch, t_q=1, dtype=torch.float64)
    cache_k, cache_v = (
        torch.randn(batch, 3, 16, 8, dtype=torch.float64),
        torch.randn(batch, 3, 16, 6, dtype=torch.float64),
    )
    k, v = cache_k[:, :, :7], cache_v[:, :, :7]  # views of a longer buffer, like KVCache.key
    is_token = torch.ones(batch, 7, dtype=torch.bool)
    is_token[1, 3:] = False
    no_key = torch.ones(batch, 7, dtype=torch.bool)
    no_key[1] = False
    mask = {
        "none": None,
        "padding": is_token[:, None, None, :],
        "arbitrary": _random_mask(batch, 3, 1, 7, seed=3),
        "empty_row": no_key[:, None, None, :],
    }[mask_kind]
    out = attention(q.float(), k.float(), v.float(), mask, causal=causal)
    allowed = torch.ones(batch, 3, 1, 7, dtype=torch.bool) if mask is None else mask.expand(batch, 3, 1, 7)
    has_key = allowed.any(-1, keepdim=True)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=allowed | ~has_key) * has_key
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-5)
    ref_out, _ = reference.batched_attention(
        q.numpy(), k.numpy(), v.numpy(), allowed.numpy(), score="scaled_dot", normalizer="softmax"
    )
    np.testing.assert_allclose(attention(q, k, v, mask, causal=causal).numpy(), ref_out, atol=1e-12)


@pytest.mark.parametrize("batch", SINGLE_QUERY_BATCHES)
def test_single_query_keeps_gradients(batch):
    q, k, v = (t.requires_grad_() for t in _qkv(b=batch, t_q=1, dtype=torch.float64))
    # fast_mode: the Jacobian checked along random directions (every entry of it at 48 x 3 rows
    # took ~15,000 forward passes).
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v), (q, k, v), fast_mode=batch > 2)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
@pytest.mark.parametrize("scale", [None, 1.0])
def test_float64_reference(normalizer, scale):
    q, k, v = _qkv(dtype=torch.float64)
    mask = _random_mask(2, 3, 5, 7)
    out, weights = attention(q, k, v, mask, normalizer=normalizer, scale=scale, return_weights=True)
    ref_out, ref_w = reference.batched_attention(
        q.numpy(),
        k.numpy(),
        v.numpy(),
        mask.numpy(),
        score="scaled_dot" if scale is None else "dot",
        normalizer=normalizer,
    )
    np.testing.assert_allclose(out.numpy(), ref_out, atol=1e-12)
    np.testing.assert_allclose(weights.numpy(), ref_w, atol=1e-12)


def test_hardmax_ties_go_to_first_position():
    q = torch.ones(1, 1, 1, 2)
    k = torch.tensor([[[[0.0, 0.0], [1.0, 1.0], [3.0, -1.0], [1.0, 1.0], [2.0, 0.0]]]])  # scores 0,2,2,2,2
    v = torch.arange(5.0).reshape(1, 1, 5, 1)
    out, weights = attention(q, k, v, normalizer="hardmax", return_weights=True)
    assert weights[0, 0, 0].tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]
    assert out.item() == 1.0


def test_hardmax_ties_first_allowed_position_under_mask():
    q = torch.ones(1, 1, 1, 1)
    k = torch.ones(1, 1, 4, 1)  # all tied
    v = torch.arange(4.0).reshape(1, 1, 4, 1)
    mask = torch.tensor([False, False, True, True])
    assert attention(q, k, v, mask[None, :], normalizer="hardmax").item() == 2.0


def test_hardmax_output_is_value_at_argmax():
    q, k, v = _qkv(t_q=11, t_k=13)
    out = attention(q, k, v, normalizer="hardmax")
    index = (q @ k.transpose(-2, -1)).argmax(-1)  # (B, H, T_q)
    expected = torch.gather(v, -2, index.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    assert torch.equal(out, expected)


def test_hardmax_chunks_equal_unchunked(monkeypatch):
    q, k, v = _qkv(t_q=37, t_k=19)
    mask = _random_mask(2, 3, 37, 19)
    row_mask = mask[:, :, :1, :]  # (B, H, 1, T_k): broadcast over queries
    whole = attention(q, k, v, mask, normalizer="hardmax", return_weights=True)
    whole_row = attention(q, k, v, row_mask, normalizer="hardmax")
    monkeypatch.setattr(attention_module, "_HARD_CHUNK_ELEMENTS", 2 * 3 * 19 * 4)  # 4 query rows a chunk
    chunked = attention(q, k, v, mask, normalizer="hardmax", return_weights=True)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    assert torch.equal(attention(q, k, v, row_mask, normalizer="hardmax"), whole_row)


def test_hardmax_chunked_causal_equals_mask(monkeypatch):
    q, k, v = _qkv(t_q=23, t_k=23)
    expected = attention(q, k, v, causal_mask(23), normalizer="hardmax")
    monkeypatch.setattr(attention_module, "_HARD_CHUNK_ELEMENTS", 2 * 3 * 23 * 5)
    assert torch.equal(attention(q, k, v, causal=True, normalizer="hardmax"), expected)


@pytest.mark.parametrize("causal", [False, True])
def test_hardmax_key_blocks_equal_one_block(monkeypatch, causal):
    """Scored a few keys at a time, with ties across blocks (repeated keys) and masked rows, the
    argmax is the same: the first maximal allowed position."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 17, 4)
    k = torch.randn(2, 3, 8, 4).repeat(1, 1, 3, 1)[:, :, :19]  # key j = key j + 8: every maximum tied
    v = torch.randn(2, 3, 19, 5)
    mask = _random_mask(2, 3, 17, 19)
    mask[0, 1, 4] = False  # no key at all
    whole = attention(q, k, v, mask, causal=causal, normalizer="hardmax", return_weights=True)
    monkeypatch.setattr(attention_module, "_HARD_KEY_BLOCK", 3)
    monkeypatch.setattr(attention_module, "_HARD_CHUNK_ELEMENTS", 2 * 3 * 3 * 5)  # 5 query rows a chunk
    blocked = attention(q, k, v, mask, causal=causal, normalizer="hardmax", return_weights=True)
    assert torch.equal(blocked[0], whole[0]) and torch.equal(blocked[1], whole[1])
    scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
    if causal:
        scores = scores.masked_fill(~causal_mask(17, 19), float("-inf"))
    first = (scores == scores.max(-1, keepdim=True).values).int().argmax(-1)  # first maximal position
    picked = blocked[1].argmax(-1)
    has_key = torch.isfinite(scores).any(-1)
    assert torch.equal(picked[has_key], first[has_key])


def test_hardmax_chunked_gradient_equals_unchunked(monkeypatch):
    """The chunks share one gather, so v's gradient (picks per value row) is the same however the
    queries are chunked, rows without an allowed key included."""
    q, k, v = _qkv(t_q=37, t_k=19, dtype=torch.float64)
    mask = _random_mask(2, 3, 37, 19)
    mask[0, 0, 5] = False  # a query row with no key: zero output, no gradient
    grads = []
    for chunk_elements in (None, 2 * 3 * 19 * 4):
        if chunk_elements is not None:
            monkeypatch.setattr(attention_module, "_HARD_CHUNK_ELEMENTS", chunk_elements)
        value = v.clone().requires_grad_()
        out = attention(q, k, value, mask, normalizer="hardmax")
        assert torch.all(out[0, 0, 5] == 0)
        (out * torch.linspace(-1, 1, out.numel(), dtype=torch.float64).view_as(out)).sum().backward()
        grads.append(value.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)


@pytest.mark.parametrize("scale", [-0.5, 0.0])
def test_hardmax_non_positive_scale_is_applied(scale):
    """A positive scale cannot move the argmax (and is skipped); a negative one reverses it, and 0
    ties every key (the first one wins)."""
    q, k, v = _qkv(t_q=6, t_k=9, dtype=torch.float64)
    out = attention(q, k, v, normalizer="hardmax", scale=scale)
    index = (scale * (q @ k.transpose(-2, -1))).argmax(-1)  # (B, H, T_q)
    expected = torch.gather(v, -2, index.unsqueeze(-1).expand(-1, -1, -1, v.shape[-1]))
    assert torch.equal(out, expected)
    if scale == 0.0:
        assert torch.equal(out, v[..., :1, :].expand_as(out))


def test_hard_gradient_reaches_values_only():
    q, k, v = (t.requires_grad_() for t in _qkv())
    attention(q, k, v, normalizer="hardmax").sum().backward()
    assert q.grad is None and k.grad is None
    # each value row gets the number of queries that picked it
    picks = torch.zeros(2, 3, 7).scatter_add_(-1, (q @ k.transpose(-2, -1)).argmax(-1), torch.ones(2, 3, 5))
    torch.testing.assert_close(v.grad, picks.unsqueeze(-1).expand_as(v))


def test_straight_through_forward_hard_backward_soft():
    q, k, v = _qkv()
    grads = []
    for straight_through, normalizer in [(True, "hardmax"), (False, "softmax")]:
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        out = attention(qq, kk, vv, normalizer=normalizer, straight_through=straight_through)
        if straight_through:
            torch.testing.assert_close(out, attention(q, k, v, normalizer="hardmax"))
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads.append((qq.grad, kk.grad, vv.grad))
    for hard_grad, soft_grad in zip(*grads):
        torch.testing.assert_close(hard_grad, soft_grad)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_fully_masked_rows_give_zeros_and_finite_gradients(normalizer, dtype, need_weights, causal):
    q, k, v = (t.requires_grad_() for t in _qkv(t_q=4, t_k=4, dtype=dtype))
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[0, :, 2, :] = False  # one empty row
    mask[1] = False  # a whole empty example
    result = attention(
        q,
        k,
        v,
        mask,
        normalizer=normalizer,
        return_weights=need_weights,
        causal=causal,
        straight_through=normalizer == "hardmax",
    )
    out = result[0] if need_weights else result
    assert torch.isfinite(out).all()
    assert (out[0, :, 2] == 0).all() and (out[1] == 0).all()
    if need_weights:
        assert (result[1][0, :, 2] == 0).all() and (result[1][1] == 0).all()
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()
    assert (v.grad[1] == 0).all()  # nothing attended in example 1


@pytest.mark.parametrize(
    "bad", [torch.ones(5, 7), torch.ones(5, 7, dtype=torch.int64), torch.zeros(5, 7, dtype=torch.uint8)]
)
def test_non_bool_mask_is_rejected(bad):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match="torch.bool"):
        attention(q, k, v, bad)


def test_bad_shapes_are_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="does not broadcast"):
        attention(q, k, v, torch.ones(5, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="d_k"):
        attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="normalizer"):
        attention(q, k, v, normalizer="sparsemax")


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_mask_with_more_batch_dims_than_the_inputs_is_rejected(normalizer, need_weights):
    q, k, v = _qkv()  # batch dims (2, 3)
    for mask_batch in [(4, 2, 3), (3, 3), (2, 1, 1, 1)]:
        with pytest.raises(ValueError, match="does not broadcast"):
            attention(
                q,
                k,
                v,
                torch.ones(*mask_batch, 5, 7, dtype=torch.bool),
                normalizer=normalizer,
                return_weights=need_weights,
            )
    narrower = attention(q, k, v, torch.ones(3, 5, 7, dtype=torch.bool), normalizer=normalizer)
    torch.testing.assert_close(narrower, attention(q, k, v, normalizer=normalizer))


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
def test_causal_with_more_queries_than_keys_is_rejected(normalizer):
    q, k, v = _qkv(t_q=7, t_k=5)
    with pytest.raises(ValueError, match="causal needs T_k >= T_q"):
        attention(q, k, v, causal=True, normalizer=normalizer)


def test_batch_dims_of_q_k_v_that_do_not_broadcast_are_rejected():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="do not broadcast"):
        attention(q, k[:1, :2], v[:1, :2])


def test_default_scale_is_inverse_sqrt_dk():
    q, k, v = _qkv(d=16)
    torch.testing.assert_close(attention(q, k, v), attention(q, k, v, scale=1 / math.sqrt(16)))


@pytest.mark.parametrize("normalizer", sorted(attention_module.NORMALIZERS))
@pytest.mark.parametrize("backend", [None, *attention_backends.BACKENDS])
@pytest.mark.parametrize("case", ["plain", "mask", "bias", "weights", "straight_through", "float16", "no_queries"])
def test_no_keys_gives_zeros_for_every_normalizer_and_backend(monkeypatch, normalizer, backend, case):
    """T_k = 0: the empty sum, zeros (..., T_q, d_v), weights (..., T_q, 0), zero gradients, never an
    error or NaN, whichever normalizer, and whichever backend (ATTNLAB_BACKEND) where it applies."""
    if backend is not None:
        monkeypatch.setattr(attention_backends, "OVERRIDE", backend)
    dtype = torch.float16 if case == "float16" else torch.float32
    q, k, v = _qkv(t_q=0 if case == "no_queries" else 4, t_k=0, dtype=dtype)
    q.requires_grad_()
    v.requires_grad_()
    kwargs = {
        "mask": torch.ones(4, 0, dtype=torch.bool) if case == "mask" else None,
        "bias": torch.zeros(4, 0, dtype=dtype) if case == "bias" else None,
        "return_weights": case == "weights",
        "straight_through": case == "straight_through" and normalizer == "hardmax",
    }
    result = attention(q, k, v, normalizer=normalizer, **kwargs)
    output = result[0] if case == "weights" else result
    assert output.shape == (*q.shape[:-1], v.shape[-1]) and output.dtype == dtype
    assert torch.equal(output, torch.zeros_like(output))
    if case == "weights":
        assert result[1].shape == (*q.shape[:-1], 0)
    output.float().sum().backward()
    assert q.grad is None or torch.equal(q.grad, torch.zeros_like(q))
    assert v.grad is None or v.grad.shape == v.shape
