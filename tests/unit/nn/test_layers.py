"""LayerNorm, Add & Norm (post-LN and pre-LN), the FFN and the layers (Agarwal §6; Vaswani §3)."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import AddNorm, DecoderLayer, EncoderLayer, MultiHeadAttention, PositionwiseFeedForward


def _layer_norm_reference(a, g, b, eps):
    """Agarwal Def. 6.1: g * (a - mu) / sigma + b, row-wise (Remark 6.2)."""
    mu = a.mean(-1, keepdim=True)
    sigma = torch.sqrt(a.var(-1, unbiased=False, keepdim=True) + eps)
    return g * (a - mu) / sigma + b


@pytest.mark.parametrize("norm_first", [False, True])
def test_add_norm_formula(norm_first):
    add_norm = AddNorm(8, norm_first=norm_first, eps=1e-5).double()
    with torch.no_grad():
        add_norm.norm.weight.normal_()
        add_norm.norm.bias.normal_()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    w = torch.randn(8, 8, dtype=torch.float64)
    sublayer = lambda y: y @ w  # noqa: E731
    g, b = add_norm.norm.weight, add_norm.norm.bias
    if norm_first:
        expected = x + sublayer(_layer_norm_reference(x, g, b, 1e-5))
    else:
        expected = _layer_norm_reference(x + sublayer(x), g, b, 1e-5)
    torch.testing.assert_close(add_norm(x, sublayer), expected)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_formula(activation):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, row by row (Agarwal Def. 6.5)."""
    ffn = PositionwiseFeedForward(8, 32, activation=activation).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    expected = act(x @ ffn.linear1.weight.T + ffn.linear1.bias) @ ffn.linear2.weight.T + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected)
    torch.testing.assert_close(ffn(x[:, 3:4]), ffn(x)[:, 3:4])  # position-wise


def test_feed_forward_rejects_unknown_activation():
    with pytest.raises(ValueError, match="activation: unknown 'swish'"):
        PositionwiseFeedForward(8, 16, activation="swish")


def test_encoder_layer_composition():
    layer = EncoderLayer(MultiHeadAttention(16, 4), PositionwiseFeedForward(16, 32)).eval()
    x = torch.randn(2, 5, 16)
    h = layer.attn_norm.norm(x + layer.self_attn(x))
    torch.testing.assert_close(layer(x), layer.ffn_norm.norm(h + layer.feed_forward(h)))


def test_decoder_layer_composition():
    layer = DecoderLayer(MultiHeadAttention(16, 4), MultiHeadAttention(16, 4), PositionwiseFeedForward(16, 32)).eval()
    y, memory = torch.randn(2, 5, 16), torch.randn(2, 7, 16)
    a = layer.self_attn_norm.norm(y + layer.self_attn(y, causal=True))
    c = layer.cross_attn_norm.norm(a + layer.cross_attn(a, memory))
    torch.testing.assert_close(layer(y, memory), layer.ffn_norm.norm(c + layer.feed_forward(c)))
