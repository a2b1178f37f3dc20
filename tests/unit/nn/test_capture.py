"""Capture: one record per attention call, per-head weights and outputs, fused path otherwise."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    MultiHeadAttention,
    capture,
)

CFG = {"vocab_size": 11, "layers": 2, "d_model": 16, "heads": 4, "d_ff": 32, "dropout": 0.0}


def test_records_of_an_encoder_decoder():
    model = EncoderDecoder(EncoderDecoderConfig(**CFG)).eval()
    src, tgt = torch.randint(1, 11, (3, 7)), torch.randint(1, 11, (3, 5))
    plain = model(src, tgt)
    with capture(model) as records:
        captured = model(src, tgt)
    torch.testing.assert_close(captured, plain, atol=1e-6, rtol=0)
    assert [(r.kind, r.layer) for r in records] == [
        ("encoder_self", 0),
        ("encoder_self", 1),
        ("decoder_self", 0),
        ("cross", 0),
        ("decoder_self", 1),
        ("cross", 1),
    ]
    shapes = {r.kind: (tuple(r.weights.shape), tuple(r.head_outputs.shape)) for r in records}
    assert shapes == {
        "encoder_self": ((3, 4, 7, 7), (3, 4, 7, 4)),
        "decoder_self": ((3, 4, 5, 5), (3, 4, 5, 4)),
        "cross": ((3, 4, 5, 7), (3, 4, 5, 4)),
    }
    for r in records:
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(r.weights.shape[:-1]))
    decoder_self = records[2].weights
    assert (decoder_self.triu(1) == 0).all()  # masked self-attention never looks ahead


def test_capture_stops_after_the_block():
    model = DecoderOnly(DecoderOnlyConfig(**CFG))
    x = torch.randint(1, 11, (2, 4))
    with capture(model) as records:
        model(x)
    model(x)
    assert len(records) == 2


def test_head_outputs_reflect_the_head_mask():
    model = DecoderOnly(DecoderOnlyConfig(**CFG)).eval()
    mask = {"self": torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])}
    with capture(model) as records:
        model(torch.randint(1, 11, (2, 4)), head_mask=mask)
    assert (records[0].head_outputs[:, 1] == 0).all()
    assert (records[1].head_outputs.abs().sum((0, 2, 3)) > 0).all()


def test_hard_attention_records_one_hot_rows():
    model = DecoderOnly(DecoderOnlyConfig(**CFG, attention="hard"))
    with capture(model) as records:
        model(torch.randint(1, 11, (2, 6)))
    for r in records:
        assert set(r.weights.unique().tolist()) <= {0.0, 1.0}
        assert (r.weights.sum(-1) == 1).all()


def test_capture_a_single_module_and_keep_graph():
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16, requires_grad=True)
    with capture(mha, detach=False) as records:
        mha(x)
    records[0].weights.sum().backward()
    assert x.grad is not None
    with pytest.raises(TypeError, match="attention_sites"):
        with capture(torch.nn.Linear(2, 2)):
            pass
