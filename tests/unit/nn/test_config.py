"""Configs: frozen, validated, with errors that name the field and the allowed values."""

from __future__ import annotations

import dataclasses

import pytest

from attnlab.nn import DecoderOnlyConfig, EncoderClassifierConfig, EncoderDecoderConfig, preset
from attnlab.nn.config import PRESETS


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"d_model": 30, "heads": 4}, "d_model: 30 is not divisible by heads=4"),
        ({"layers": -1}, "layers: must be a positive integer"),
        ({"d_ff": 0}, "d_ff: must be a positive integer"),
        ({"score": "cosine"}, "score: unknown 'cosine'; allowed: additive, bilinear, dot, scaled_dot"),
        ({"attention": "sparse"}, "attention: unknown 'sparse'; allowed: hard, soft"),
        (
            {"positional": "t5"},
            "positional: unknown 't5'; allowed: alibi, gehring_joint, gehring_sum, learned, none, relative, rope, "
            "sinusoidal",
        ),
        ({"relative_clip": 0}, "relative_clip: must be a positive integer"),
        ({"positional": "relative", "score": "additive"}, "positional: relative .* needs a dot-product score"),
        ({"randomized_positions": -3}, "randomized_positions: must be a positive integer"),
        (
            {"positional": "none", "randomized_positions": 64},
            "randomized_positions: does not apply to positional='none'",
        ),
        (
            {"positional": "learned", "max_len": 32, "randomized_positions": 64},
            r"randomized_positions: M=64 needs learned positions for all of \[0, M\), but max_len=32",
        ),
        ({"activation": "tanh"}, "activation: unknown 'tanh'"),
        ({"dropout": 1.5}, r"dropout: must lie in \[0, 1\)"),
        ({"d_model": "64"}, "d_model: expected int, got '64'"),
        ({"norm_first": 1}, "norm_first: expected bool, got 1"),
        ({"layers": 2.0}, "layers: expected int, got 2.0"),
        ({"pad_id": 99}, "pad_id: must lie in"),
        ({"straight_through": True}, "straight_through: only applies to attention='hard'"),
        ({"positional_combine": "concat", "positional_dim": 64}, "positional_dim: must lie in"),
        ({"layer_norm_eps": float("nan")}, "layer_norm_eps: must be a finite number, got nan"),
        ({"layer_norm_eps": float("inf")}, "layer_norm_eps: must be a finite number, got inf"),
        ({"dropout": float("nan")}, "dropout: must be a finite number"),
        (
            {"d_k": 16, "heads_per_layer": {"self": [True, False]}},
            r"heads_per_layer\['self'\]: expected a list of head counts",
        ),
    ],
)
@pytest.mark.parametrize("cls", [EncoderDecoderConfig, EncoderClassifierConfig, DecoderOnlyConfig])
def test_invalid_values_raise_value_error_naming_the_field(cls, changes, message):
    with pytest.raises(ValueError, match=message):
        cls(**changes)


def test_model_specific_fields():
    with pytest.raises(ValueError, match="pooling: unknown 'max'; allowed: eos, first, mean"):
        EncoderClassifierConfig(pooling="max")
    with pytest.raises(ValueError, match="num_classes"):
        EncoderClassifierConfig(num_classes=1)
    with pytest.raises(ValueError, match="tie_embeddings"):
        DecoderOnlyConfig(tie_embeddings=True, positional_combine="concat")
    with pytest.raises(ValueError, match="decoder_layers"):
        EncoderDecoderConfig(decoder_layers=0)


def test_from_dict_rejects_unknown_keys_listing_allowed():
    with pytest.raises(
        ValueError, match=r"unknown key 'n_layers' for EncoderDecoderConfig; allowed: vocab_size, layers"
    ):
        EncoderDecoderConfig.from_dict({"n_layers": 3})
    cfg = EncoderDecoderConfig.from_dict({"layers": 3, "tgt_vocab_size": 50})
    assert cfg.layers == 3 and cfg.target_vocab_size == 50 and cfg.decoder_depth == 3


def test_from_dict_ignores_the_retired_linear_key():
    """An older config.json's ``linear`` (now the runtime setting ATTNLAB_LINEAR) is accepted and
    ignored; it is no field of the config any more."""
    cfg = EncoderDecoderConfig.from_dict({"layers": 3, "linear": "onednn"})
    assert cfg == EncoderDecoderConfig(layers=3) and "linear" not in cfg.to_dict()


def test_frozen_and_derived_values():
    cfg = EncoderDecoderConfig(d_model=64, heads=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 32  # type: ignore[misc]
    assert (cfg.head_dim_k, cfg.head_dim_v, cfg.normalizer) == (8, 8, "softmax")
    assert EncoderDecoderConfig(d_model=64, heads=8, d_k=64).head_dim_v == 64
    assert EncoderDecoderConfig(attention="hard").normalizer == "hardmax"
    assert cfg.to_dict()["kind"] == "encoder_decoder"
    assert EncoderDecoderConfig.from_dict({k: v for k, v in cfg.to_dict().items() if k != "kind"}) == cfg


def test_presets():
    base = preset("base")
    assert (base.layers, base.d_model, base.heads, base.d_ff) == (6, 512, 8, 2048)  # Vaswani base model
    assert preset("tiny", DecoderOnlyConfig, vocab_size=10).vocab_size == 10
    assert set(PRESETS) == {"tiny", "small", "base"}
    with pytest.raises(ValueError, match="preset: unknown 'huge'"):
        preset("huge")
