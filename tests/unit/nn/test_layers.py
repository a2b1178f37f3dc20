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


@pytest.mark.parametrize("placement", ["post", "pre", "sandwich", "output"])
def test_add_norm_formula(placement):
    add_norm = AddNorm(8, placement=placement, eps=1e-5).double()
    with torch.no_grad():
        for parameter in add_norm.parameters():
            parameter.normal_()
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    w = torch.randn(8, 8, dtype=torch.float64)
    sublayer = lambda y: y @ w  # noqa: E731

    def norm(a, module=add_norm.norm):
        return _layer_norm_reference(a, module.weight, module.bias, 1e-5)

    expected = {
        "post": lambda: norm(x + sublayer(x)),
        "pre": lambda: x + sublayer(norm(x)),
        "sandwich": lambda: x + norm(sublayer(norm(x)), add_norm.post_norm),
        "output": lambda: x + norm(sublayer(x)),
    }[placement]()
    torch.testing.assert_close(add_norm(x, sublayer), expected)
    assert hasattr(add_norm, "post_norm") == (placement == "sandwich")


def test_parallel_residual_formula():
    """x + Attn(Norm_1(x)) + FFN(Norm_2(x)) (GPT-NeoX), both sub-layers on the layer's input."""
    torch.manual_seed(2)
    layer = EncoderLayer(
        MultiHeadAttention(16, 4), PositionwiseFeedForward(16, 32), placement="pre", parallel=True
    ).double()
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.normal_(std=0.5)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    first, second = layer.attn_norm.norm, layer.ffn_norm.norm
    norm1 = _layer_norm_reference(x, first.weight, first.bias, 1e-5)
    norm2 = _layer_norm_reference(x, second.weight, second.bias, 1e-5)
    expected = x + layer.self_attn(norm1, causal=True) + layer.feed_forward(norm2)
    torch.testing.assert_close(layer(x, causal=True), expected)
    with pytest.raises(ValueError, match="parallel_residual"):
        EncoderLayer(MultiHeadAttention(16, 4), PositionwiseFeedForward(16, 32), placement="post", parallel=True)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_formula(activation):
    """FFN(x) = act(x W_1 + b_1) W_2 + b_2, row by row (Agarwal Def. 6.5)."""
    ffn = PositionwiseFeedForward(8, 32, activation=activation).double()
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    expected = act(x @ ffn.linear1.weight.T + ffn.linear1.bias) @ ffn.linear2.weight.T + ffn.linear2.bias
    torch.testing.assert_close(ffn(x), expected)
    torch.testing.assert_close(ffn(x[:, 3:4]), ffn(x)[:, 3:4])  # position-wise


def test_geglu_equals_gemmas_mlp():
    """(GELU_tanh(x W_gate) * x W_up) W_2, with W_1 = [W_gate; W_up] (Gemma's ``gelu_pytorch_tanh``)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma2.modeling_gemma2 import Gemma2MLP

    torch.manual_seed(4)
    config = transformers.Gemma2Config(hidden_size=8, intermediate_size=12, hidden_activation="gelu_pytorch_tanh")
    theirs = Gemma2MLP(config).double()
    ours = PositionwiseFeedForward(8, 12, activation="geglu", bias=False).double()
    with torch.no_grad():
        ours.linear1.weight.copy_(torch.cat([theirs.gate_proj.weight, theirs.up_proj.weight]))
        ours.linear2.weight.copy_(theirs.down_proj.weight)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-15, atol=1e-15)


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
