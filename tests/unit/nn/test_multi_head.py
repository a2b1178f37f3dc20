"""MultiHeadAttention: equivalence with torch.nn.MultiheadAttention, float64 sum-of-heads reference,
head mask xi_h (Michel §2.3), the three uses (Vaswani §3.2.3), the KV cache and permutation equivariance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from attnlab import kernels
from attnlab.nn import KVCache, MultiHeadAttention, causal_mask, masking_heads, padding_mask, trace
from attnlab.nn.scores import SCORES
from tests import reference
from tests.unit.nn.attending import attend, masked

D_MODEL, HEADS = 16, 4


def _torch_twin(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    twin = nn.MultiheadAttention(mha.d_model, mha.heads, batch_first=True)
    with torch.no_grad():
        twin.in_proj_weight.copy_(mha.in_proj_weight)
        twin.in_proj_bias.copy_(mha.in_proj_bias)
        twin.out_proj.weight.copy_(mha.out_proj.weight)
        twin.out_proj.bias.copy_(mha.out_proj.bias)
    return twin.eval()


def _randomise_biases(mha: MultiHeadAttention) -> None:
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding", "arbitrary"])
@pytest.mark.parametrize("use", ["self", "cross"])
def test_equals_torch_multihead_attention(mask_kind, use):
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    _randomise_biases(mha)
    twin = _torch_twin(mha)
    b, t_q, t_k = 3, 6, 6 if use == "self" else 9
    x = torch.randn(b, t_q, D_MODEL)
    memory = x if use == "self" else torch.randn(b, t_k, D_MODEL)
    is_token = torch.ones(b, t_k, dtype=torch.bool)
    is_token[1, -2:] = False
    arbitrary = torch.rand(t_q, t_k, generator=torch.Generator().manual_seed(3)) < 0.5
    arbitrary[:, 0] = True  # torch's reference returns NaN on empty rows; keep every row non-empty
    ours_mask, torch_kwargs = {
        "none": (None, {}),
        "causal": (causal_mask(t_q, t_k), {"attn_mask": ~causal_mask(t_q, t_k)[0, 0]}),
        "padding": (padding_mask(is_token), {"key_padding_mask": ~is_token}),
        "arbitrary": (arbitrary, {"attn_mask": ~arbitrary}),
    }[mask_kind]
    ours = attend(mha, x, None if use == "self" else memory, mask=ours_mask)
    expected, expected_weights = twin(x, memory, memory, average_attn_weights=False, **torch_kwargs)
    torch.testing.assert_close(ours.output, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours.weights, expected_weights, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("score", sorted(SCORES))
@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
@pytest.mark.parametrize("use", ["self", "cross"])
def test_float64_sum_of_heads_reference(score, normalizer, use):
    """output = b_o + sum_h xi_h Att_h W_o^h  (Michel §2.2 Eq. 1 and §2.3) for every score and normalizer."""
    mha = MultiHeadAttention(D_MODEL, HEADS, score=score, normalizer=normalizer).double()
    _randomise_biases(mha)
    with torch.no_grad():
        for p in mha.score.parameters():
            p.add_(0.3 * torch.randn_like(p))
    x = torch.randn(1, 5, D_MODEL, dtype=torch.float64)
    memory = None if use == "self" else torch.randn(1, 7, D_MODEL, dtype=torch.float64)
    t_k = 5 if memory is None else 7
    allowed = torch.rand(5, t_k, generator=torch.Generator().manual_seed(5)) < 0.7
    xi = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    out = masked(mha, x, memory, mask=allowed, head_mask=xi)[0]
    expected = reference.multi_head(mha, x[0], None if memory is None else memory[0], allowed.numpy(), xi.numpy())
    np.testing.assert_allclose(out.detach().numpy(), expected, atol=1e-10)


def test_all_ones_head_mask_changes_nothing():
    mha = MultiHeadAttention(D_MODEL, HEADS)
    x = torch.randn(2, 5, D_MODEL)
    plain = mha(x)
    assert torch.equal(masked(mha, x, head_mask=torch.ones(HEADS)), plain)
    assert torch.equal(masked(mha, x, head_mask=torch.ones(2, HEADS)), plain)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
def test_masked_head_does_not_depend_on_its_weights(normalizer):
    mha = MultiHeadAttention(D_MODEL, HEADS, normalizer=normalizer)
    x = torch.randn(2, 5, D_MODEL)
    xi = torch.tensor([1.0, 1.0, 0.0, 1.0])
    before = masked(mha, x, head_mask=xi)
    d = mha.d_k
    with torch.no_grad():
        for block in mha.in_proj_weight.split(HEADS * d):  # W^Q, W^K, W^V
            block[2 * d : 3 * d].normal_(std=5.0)  # scramble head 2 only
    after = masked(mha, x, head_mask=xi)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    assert not torch.allclose(mha(x), before, atol=1e-3)  # head 2 mattered when unmasked


def test_head_mask_equals_zeroed_output_columns():
    """Masking head h is the same as zeroing its block of W^O (Michel §2.3)."""
    mha = MultiHeadAttention(D_MODEL, HEADS)
    x = torch.randn(2, 5, D_MODEL)
    without = masked(mha, x, head_mask=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    with torch.no_grad():
        mha.out_proj.weight[:, mha.d_v : 2 * mha.d_v] = 0
    torch.testing.assert_close(mha(x), without, atol=1e-6, rtol=0)


def test_per_example_head_mask():
    mha = MultiHeadAttention(D_MODEL, HEADS)
    x = torch.randn(2, 5, D_MODEL)
    xi = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    both = masked(mha, x, head_mask=xi)
    for row in range(2):
        torch.testing.assert_close(both[row : row + 1], masked(mha, x[row : row + 1], head_mask=xi[row]))


def test_head_mask_is_differentiable_and_gives_head_contribution():
    """dL/dxi_h at xi = 1 equals <dL/dout, Att_h>: the head's own contribution (Michel §3)."""
    mha = MultiHeadAttention(D_MODEL, HEADS)
    x = torch.randn(2, 5, D_MODEL)
    xi = torch.ones(HEADS, requires_grad=True)
    result = attend(mha, x, head_mask=xi)
    probe = torch.randn_like(result.output)
    (result.output * probe).sum().backward()
    contributions = mha.head_contributions(result.head_outputs.detach())  # (B, H, T, d_model)
    expected = torch.einsum("bhtm,btm->h", contributions, probe)
    torch.testing.assert_close(xi.grad, expected, atol=1e-5, rtol=1e-5)


def test_head_contributions_sum_to_output():
    mha = MultiHeadAttention(D_MODEL, HEADS)
    result = attend(mha, torch.randn(2, 5, D_MODEL))
    summed = mha.head_contributions(result.head_outputs).sum(1) + mha.out_proj.bias
    torch.testing.assert_close(summed, result.output, atol=1e-5, rtol=1e-5)


def test_weights_are_per_head_not_averaged():
    mha = MultiHeadAttention(D_MODEL, HEADS)
    result = attend(mha, torch.randn(2, 5, D_MODEL))
    assert result.weights.shape == (2, HEADS, 5, 5)
    torch.testing.assert_close(result.weights.sum(-1), torch.ones(2, HEADS, 5))
    assert not torch.allclose(result.weights[:, 0], result.weights[:, 1])


@pytest.mark.parametrize("d_k,d_v", [(D_MODEL, None), (3, 5), (8, 2)])
def test_custom_head_sizes(d_k, d_v):
    """d_k = d_model (Michel §2.2) and other sizes."""
    mha = MultiHeadAttention(D_MODEL, HEADS, d_k=d_k, d_v=d_v).double()
    x = torch.randn(1, 4, D_MODEL, dtype=torch.float64)
    result = attend(mha, x)
    assert result.head_outputs.shape == (1, HEADS, 4, d_v or d_k)
    np.testing.assert_allclose(result.output[0].detach().numpy(), reference.multi_head(mha, x[0]), atol=1e-10)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
@pytest.mark.parametrize("score", sorted(SCORES))
def test_self_attention_without_positions_is_permutation_equivariant(normalizer, score):
    """Li's slides: swapping rows of the input swaps the same rows of the output."""
    mha = MultiHeadAttention(D_MODEL, HEADS, normalizer=normalizer, score=score).double()
    x = torch.randn(2, 7, D_MODEL, dtype=torch.float64)
    perm = torch.randperm(7)
    torch.testing.assert_close(mha(x[:, perm]), mha(x)[:, perm], atol=1e-10, rtol=0)


@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
def test_self_attention_cache_equals_full_causal(normalizer):
    mha = MultiHeadAttention(D_MODEL, HEADS, normalizer=normalizer).eval()
    x = torch.randn(2, 6, D_MODEL)
    full = mha(x, causal=True)
    cache = KVCache()
    steps = [mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(6)]
    assert len(cache) == 6
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.integers(1, 9), min_size=1, max_size=12))
def test_self_attention_cache_grows_past_its_capacity(chunks):
    """Chunks of any sizes, across several doublings of the buffers, give the full causal output."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).double().eval()
    x = torch.randn(2, sum(chunks), D_MODEL, dtype=torch.float64)
    full = mha(x, causal=True)
    cache, start, steps = KVCache(), 0, []
    with torch.no_grad():
        for size in chunks:
            steps.append(mha(x[:, start : start + size], causal=True, cache=cache))
            start += size
    assert len(cache) == sum(chunks) and cache.key.shape[-2] == sum(chunks)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-10, rtol=0)


def test_module_without_heads_counts_cached_keys():
    """A pruned module with no heads outputs W^O's bias; under a cache its weights still span every key so far."""
    mha = MultiHeadAttention(D_MODEL, 0, d_k=4).eval()
    x = torch.randn(2, 5, D_MODEL)
    cache, seen = KVCache(), 0
    for size in (2, 1, 2):
        out = attend(mha, x[:, seen : seen + size], causal=True, cache=cache)
        seen += size
        assert len(cache) == seen
        assert out.weights.shape == (2, 0, size, seen) and out.head_outputs.shape == (2, 0, size, mha.d_v)
        torch.testing.assert_close(out.output, mha.out_proj.bias.expand(2, size, D_MODEL))


def test_self_attention_cache_keeps_the_gradient():
    """With autograd on, the cached steps backpropagate like the full causal pass."""
    mha = MultiHeadAttention(D_MODEL, HEADS).double()
    x = torch.randn(2, 20, D_MODEL, dtype=torch.float64)
    mha(x, causal=True).square().sum().backward()
    full_grad = mha.in_proj_weight.grad.clone()
    mha.zero_grad()
    cache = KVCache()
    torch.cat([mha(x[:, t : t + 1], causal=True, cache=cache) for t in range(20)], 1).square().sum().backward()
    torch.testing.assert_close(mha.in_proj_weight.grad, full_grad, atol=1e-10, rtol=0)


def test_cross_attention_cache_projects_memory_once():
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    y, memory = torch.randn(2, 3, D_MODEL), torch.randn(2, 8, D_MODEL)
    cache = KVCache()
    first = mha(y, memory, cache=cache)
    kept = cache.key
    second = mha(y, torch.zeros_like(memory), cache=cache)  # memory ignored once cached
    assert cache.key.data_ptr() == kept.data_ptr()
    assert cache.key.is_contiguous() and cache.value.is_contiguous()  # streamed every step: no strided view
    torch.testing.assert_close(first, second)
    torch.testing.assert_close(first, mha(y, memory))


def test_distinct_key_and_value_inputs():
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    twin = _torch_twin(mha)
    q, k, v = torch.randn(2, 3, D_MODEL), torch.randn(2, 5, D_MODEL), torch.randn(2, 5, D_MODEL)
    torch.testing.assert_close(mha(q, k, v), twin(q, k, v)[0], atol=1e-5, rtol=1e-5)


def test_bad_arguments():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 4)
    with pytest.raises(ValueError, match="score: unknown 'cosine'"):
        MultiHeadAttention(D_MODEL, HEADS, score="cosine")
    with pytest.raises(ValueError, match="normalizer"):
        MultiHeadAttention(D_MODEL, HEADS, normalizer="argmax")
    mha = MultiHeadAttention(D_MODEL, HEADS)
    with pytest.raises(ValueError, match="head_mask"):
        attend(mha, torch.randn(1, 3, D_MODEL), head_mask=torch.ones(HEADS + 1))
    with pytest.raises(TypeError, match="torch.bool"):
        mha(torch.randn(1, 3, D_MODEL), mask=torch.ones(3, 3))


@pytest.mark.parametrize("causal", [False, True])
def test_head_mask_stays_on_the_fused_kernel(monkeypatch, causal):
    """Soft attention without weights, head mask or not, goes through a fused kernel (SDPA, or
    attnlab's own on a CPU where it is built): no slower fallback."""
    calls = []
    real_sdpa, real_short = torch.nn.functional.scaled_dot_product_attention, kernels.short_attention

    def sdpa_spy(*args, **kwargs):
        calls.append(kwargs.get("is_causal", False))
        return real_sdpa(*args, **kwargs)

    def short_spy(*args, **kwargs):
        calls.append(kwargs["causal"])
        return real_short(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa_spy)
    monkeypatch.setattr(kernels, "short_attention", short_spy)
    mha = MultiHeadAttention(D_MODEL, HEADS)
    xi = torch.tensor([1.0, 0.0, 0.5, 1.0], requires_grad=True)
    with masking_heads(mha, xi), trace(mha, cache="attn.z"):  # xi and reading z: hooks on z
        mha(torch.randn(2, 5, D_MODEL), causal=causal).sum().backward()
    assert calls == [causal]  # one fused call, using is_causal rather than a materialised mask
    assert xi.grad is not None and xi.grad[1] != 0
    attend(mha, torch.randn(2, 5, D_MODEL))
    assert len(calls) == 1  # reading the weights (the pattern site) takes the explicit path


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_with_empty_rows(dtype):
    mha = MultiHeadAttention(D_MODEL, HEADS).to(dtype)
    x = torch.randn(2, 4, D_MODEL, dtype=dtype, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    mask[1] = False
    out = masked(mha, x, mask=mask, head_mask=torch.ones(HEADS))
    assert torch.isfinite(out).all()
    out.float().sum().backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("score", ["scaled_dot", "dot"])
@pytest.mark.parametrize("normalizer", ["softmax", "hardmax"])
def test_grouped_query_step_without_copies_equals_the_repeated_key_values(score, normalizer):
    """A decoding step of grouped-query attention folds each group's query heads into query rows
    (no K/V copy per head): outputs and head outputs (z) equal the repeat_interleave path's,
    with a padding mask and a head mask, at every step of a KV cache."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, 6, kv_heads=2, score=score, normalizer=normalizer).double().eval()
    assert mha._attend == mha._attend_grouped
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    mask = padding_mask(torch.tensor([[True] * 5, [False, True, True, True, True]]))  # (B, 1, 1, T)
    head_mask = torch.tensor([1.0, 0.0, 0.5, 1.0, 1.0, 2.0], dtype=torch.float64)
    caches = {"grouped": KVCache(), "shared": KVCache()}
    with torch.no_grad():
        for t in range(5):
            found = {}
            for name, cache in caches.items():
                mha._attend = mha._attend_grouped if name == "grouped" else mha._attend_shared
                with masking_heads(mha, head_mask), trace(mha, cache="attn.z") as seen:  # z keeps the fold
                    output = mha(x[:, t : t + 1], causal=True, cache=cache, mask=mask[..., : t + 1])
                found[name] = (output, seen.cache["attn.z"])
            torch.testing.assert_close(found["grouped"][0], found["shared"][0], atol=1e-12, rtol=0)
            torch.testing.assert_close(found["grouped"][1], found["shared"][1], atol=1e-12, rtol=0)


def test_grouped_query_fold_is_chosen_only_for_equal_groups_and_head_free_scores():
    assert MultiHeadAttention(24, 6, kv_heads=2)._attend.__name__ == "_attend_grouped"
    assert MultiHeadAttention(24, 6)._attend.__name__ == "_attend_shared"
    assert MultiHeadAttention(24, 6, kv_heads=2, score="bilinear")._attend.__name__ == "_attend_shared"
