"""ALiBi (Press et al. 2022) and Shaw et al. (2018) relative positions against float64 references
written from the papers' formulas, and what every encoding inside attention must keep: causality,
padding invariance, cache == full at every offset, grouped-query attention, head masks and pruning."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderClassifier,
    EncoderClassifierConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    MultiHeadAttention,
    attention,
    attention_backends,
    masking_heads,
)
from attnlab.nn.head_subsets import head_subset_state
from attnlab.nn.position_bias import alibi_slopes
from tests.unit.nn.attending import attend, masked

IN_ATTENTION = ["alibi", "relative", "rope"]
TINY = {"vocab_size": 13, "layers": 2, "d_model": 16, "heads": 4, "d_ff": 32, "dropout": 0.0, "relative_clip": 3}


def _paper_slopes(n: int) -> list[float]:
    """Press et al.'s ``get_slopes``, transcribed from their reference implementation."""

    def power_of_2(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + _paper_slopes(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("heads", range(1, 17))
def test_alibi_slopes_are_the_papers(heads: int) -> None:
    assert alibi_slopes(heads) == pytest.approx(_paper_slopes(heads), rel=1e-15)
    if heads & (heads - 1) == 0:  # the geometric sequence 2^(-8/H), 2^(-16/H), ...
        assert alibi_slopes(heads) == pytest.approx([2 ** (-8 * h / heads) for h in range(1, heads + 1)])


def _projections(mha: MultiHeadAttention, x: torch.Tensor):
    """q, k, v per head, (B, H, T, d), from the module's own W^Q, W^K, W^V, in float64."""
    d, h = mha.d_k, mha.heads
    w, b = mha.in_proj_weight.double(), mha.in_proj_bias.double()
    q, k, v = (x @ w.t() + b).split([h * d, h * d, h * mha.d_v], dim=-1)
    split = lambda t: t.view(x.shape[0], x.shape[1], h, -1).transpose(1, 2)  # noqa: E731
    return split(q), split(k), split(v)


def _alibi_reference(mha: MultiHeadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """softmax(q_i . k_j / sqrt(d) - m_h |i - j|) over allowed j, from Press et al. §3, in float64."""
    q, k, v = _projections(mha, x)
    t = x.shape[1]
    slopes = torch.tensor(_paper_slopes(mha.heads), dtype=torch.float64)
    i, j = torch.arange(t).unsqueeze(1), torch.arange(t).unsqueeze(0)
    scores = q @ k.transpose(-1, -2) / math.sqrt(mha.d_k) - slopes[:, None, None] * (i - j).abs()
    if causal:
        scores = scores.masked_fill(j > i, -math.inf)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [4, 6])
def test_alibi_weights_equal_the_papers_formula(causal: bool, heads: int) -> None:
    torch.manual_seed(0)
    mha = MultiHeadAttention(24, heads, position_bias="alibi").double()
    x = torch.randn(2, 9, 24, dtype=torch.float64) * 2
    out = attend(mha, x, causal=causal)
    reference = _alibi_reference(mha, x, causal)
    torch.testing.assert_close(out.weights, reference, rtol=1e-12, atol=1e-12)
    _, _, v = _projections(mha, x)
    torch.testing.assert_close(out.head_outputs, reference @ v, rtol=1e-12, atol=1e-12)


def test_alibi_fused_path_equals_explicit_with_masks(monkeypatch) -> None:
    """The bias reaches SDPA as a float attn_mask, with the boolean mask folded in as -inf; a row
    with no allowed key gives 0, as on the explicit path."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, 3, 6, 8, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(1, 3, 6, 6, dtype=torch.float64)
    mask = torch.rand(2, 1, 6, 6) > 0.3
    mask[0, 0, 2] = False  # a row with no key at all
    for causal in (False, True):
        explicit = attention(q, k, v, mask, causal=causal, bias=bias, return_weights=True)[0]
        monkeypatch.setattr(attention_backends, "OVERRIDE", "sdpa")
        fused = attention(q, k, v, mask, causal=causal, bias=bias)
        monkeypatch.setattr(attention_backends, "OVERRIDE", None)
        torch.testing.assert_close(fused, explicit, rtol=1e-12, atol=1e-12)
    assert torch.equal(fused[0, :, 2], torch.zeros_like(fused[0, :, 2]))


def test_attention_rejects_a_bias_of_the_wrong_kind() -> None:
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="bias must be a floating tensor"):
        attention(q, q, q, bias=torch.ones(4, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"bias of shape \(3, 4, 4\) does not broadcast"):
        attention(q, q, q, bias=torch.zeros(3, 4, 4))


def test_hard_alibi_takes_the_argmax_of_the_biased_scores() -> None:
    torch.manual_seed(2)
    mha = MultiHeadAttention(16, 4, position_bias="alibi", normalizer="hardmax").double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    out = attend(mha, x, causal=True)
    soft = _alibi_reference(mha, x, causal=True)
    expected = torch.nn.functional.one_hot(soft.argmax(dim=-1), 7).double()
    assert torch.equal(out.weights, expected)


def _shaw_loop(mha: MultiHeadAttention, x: torch.Tensor, causal: bool) -> torch.Tensor:
    """z_i = sum_j alpha_ij (x_j W^V + a^V_ij), e_ij = x_i W^Q (x_j W^K + a^K_ij)^T / sqrt(d_z),
    a_ij = w_{clip(j - i, k)} (Shaw et al. 2018, Eqs. 3-5), one (b, h, i, j) at a time in float64."""
    q, k, v = _projections(mha, x)
    table_k = mha.position_bias.key_table.double()
    table_v = mha.position_bias.value_table.double()
    clip = mha.position_bias.clip
    batch, heads, t, d = q.shape
    z = torch.zeros(batch, heads, t, mha.d_v, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            for i in range(t):
                keys = [j for j in range(t) if not causal or j <= i]
                row = lambda j, i=i: max(-clip, min(clip, j - i)) + clip  # noqa: E731
                e = torch.stack([q[b, h, i] @ (k[b, h, j] + table_k[row(j)]) / math.sqrt(d) for j in keys])
                alpha = torch.softmax(e, dim=0)
                z[b, h, i] = sum(alpha[n] * (v[b, h, j] + table_v[row(j)]) for n, j in enumerate(keys))
    return z


@pytest.mark.parametrize("causal", [False, True])
def test_relative_equals_a_loop_over_shaws_equations(causal: bool) -> None:
    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 2, position_bias="relative", relative_clip=2).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    out = attend(mha, x, causal=causal)
    torch.testing.assert_close(out.head_outputs, _shaw_loop(mha, x, causal), rtol=1e-12, atol=1e-12)
    plain = mha(x, causal=causal)  # without the pattern read: the same output
    torch.testing.assert_close(plain, out.output, rtol=1e-12, atol=1e-12)


def _decoder(positional: str, **extra) -> DecoderOnly:
    torch.manual_seed(4)
    return DecoderOnly(DecoderOnlyConfig(**{**TINY, "positional": positional, **extra})).double().eval()


@pytest.mark.parametrize("positional", IN_ATTENTION)
def test_causal_a_later_token_changes_no_earlier_logit(positional: str) -> None:
    model = _decoder(positional)
    tokens = torch.randint(1, 13, (2, 10))
    changed = tokens.clone()
    changed[:, 6:] = torch.randint(1, 13, (2, 4))
    torch.testing.assert_close(model(changed)[:, :6], model(tokens)[:, :6], rtol=0, atol=0)


@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("positional", IN_ATTENTION)
def test_cache_equals_full_at_every_offset(positional: str, kv_heads: int | None) -> None:
    model = _decoder(positional, kv_heads=kv_heads)
    tokens = torch.randint(1, 13, (3, 11))
    head_mask = {"self": torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.5, 1.0]], dtype=torch.float64)}
    with masking_heads(model, head_mask):
        full = model(tokens)
        for prompt in (1, 4):
            state = model.new_state()
            pieces = [model(tokens[:, :prompt], state=state)]
            for start in range(prompt, 11, 2):  # two tokens, then one, at every later offset
                pieces.append(model(tokens[:, start : start + 2], state=state))
            torch.testing.assert_close(torch.cat(pieces, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positional", IN_ATTENTION)
def test_left_padding_changes_no_real_tokens_logits(positional: str) -> None:
    model = _decoder(positional)
    tokens = torch.randint(1, 13, (1, 6))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), tokens], dim=1)
    torch.testing.assert_close(model(padded)[:, 3:], model(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positional", IN_ATTENTION)
def test_encoder_classifier_is_padding_invariant(positional: str) -> None:
    torch.manual_seed(5)
    model = EncoderClassifier(EncoderClassifierConfig(**TINY, positional=positional)).double().eval()
    tokens = torch.randint(1, 13, (1, 7))
    padded = torch.cat([tokens, torch.zeros(1, 4, dtype=torch.long)], dim=1)
    torch.testing.assert_close(model(padded), model(tokens), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("positional", ["alibi", "relative"])
def test_encoder_decoder_cache_equals_full(positional: str) -> None:
    torch.manual_seed(6)
    model = EncoderDecoder(EncoderDecoderConfig(**TINY, positional=positional)).double().eval()
    src, tgt = torch.randint(1, 13, (2, 8)), torch.randint(1, 13, (2, 6))
    memory = model.encode(src)
    full = model.decode(tgt, memory)
    state = model.new_state()
    steps = [model.decode(tgt[:, t : t + 1], memory, state=state) for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert model.decoder.layers[0].cross_attn.position_bias is None  # only self-attention is biased


@pytest.mark.parametrize("positional", ["alibi", "relative"])
def test_pruning_keeps_each_heads_own_bias(positional: str) -> None:
    """A head's ALiBi slope (or the shared Shaw tables) survives physical pruning: the pruned module
    equals the original with the other heads masked (Michel §2.3)."""
    torch.manual_seed(7)
    mha = MultiHeadAttention(16, 4, position_bias=positional, relative_clip=3).double()
    keep = [0, 2]
    pruned = MultiHeadAttention(16, 2, d_k=4, position_bias=positional, relative_clip=3).double()
    pruned.load_state_dict(head_subset_state(mha, keep))
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=torch.float64)
    expected = masked(mha, x, causal=True, head_mask=mask)
    torch.testing.assert_close(pruned(x, causal=True), expected, rtol=1e-12, atol=1e-12)
