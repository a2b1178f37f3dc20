"""Configs: frozen, validated, with errors that name the field and the allowed values."""

from __future__ import annotations

import dataclasses

import pytest

from attnlab.nn import DecoderOnlyConfig, EncoderClassifierConfig, EncoderDecoderConfig, preset
from attnlab.nn.model_configs import PRESETS


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


ROPE = {"positional": "rope"}


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"qkv_bias": 1}, "qkv_bias: expected bool or None, got 1"),
        ({**ROPE, "rotary_fraction": 0.0}, r"rotary_fraction: must lie in \(0, 1\]"),
        ({**ROPE, "rotary_fraction": 0.1}, r"rotary_fraction: int\(d_k \* rotary_fraction\) = 1 rotated dims"),
        (
            {**ROPE, "rope_scaling": {"rope_type": "ntk"}},
            "rope_scaling: unknown type 'ntk'; supported: default, linear",
        ),
        (
            {**ROPE, "rope_scaling": {"type": "yarn", "factor": 2.0}},
            "rope_scaling: .* 'original_max_position_embeddings'",
        ),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling: applies to positional='rope' only"),
        ({"parallel_residual": True}, "parallel_residual: needs norm layers with a residual branch"),
        ({"qk_norm": "layer"}, "qk_norm: unknown 'layer'; allowed: full, head, none"),
        ({"sliding_layers": [0]}, "sliding_layers: needs sliding_window"),
        (
            {"sliding_window": 4, "sliding_layers": [0, 5]},
            r"sliding_layers: expected distinct layer indices in \[0, 2\)",
        ),
        ({"sliding_window": 0}, "sliding_window: must be a positive integer"),
        ({"sliding_window": 4, "local_rope_base": 10.0}, "local_rope_base: needs sliding_window and positional='rope'"),
        ({**ROPE, "sliding_window": 4, "local_rope_base": -1.0}, "local_rope_base: must be a positive number"),
        ({"norm_placement": "middle"}, "norm_placement: unknown 'middle'; allowed: output, post, pre, sandwich"),
        ({"norm": "group"}, "norm: unknown 'group'; allowed: layer, rms, rms_one_plus"),
        ({"activation": "reglu"}, "activation: unknown 'reglu'; allowed: geglu, gelu, gelu_tanh, relu, swiglu"),
        ({"attention_softcap": 0.0}, "attention_softcap: must be a positive number"),
        ({"final_softcap": -2.0}, "final_softcap: must be a positive number"),
        ({"query_scale": 0.5, "score": "additive"}, "query_scale: replaces the scale of score='scaled_dot'"),
    ],
)
def test_the_model_family_fields_are_validated_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=message):
        DecoderOnlyConfig(**changes)


@pytest.mark.parametrize("changes", [{"sliding_window": 4}, {"final_softcap": 30.0}])
@pytest.mark.parametrize("cls", [EncoderDecoderConfig, EncoderClassifierConfig])
def test_local_attention_and_capped_logits_are_for_language_models(cls, changes):
    with pytest.raises(ValueError, match=f"{next(iter(changes))}: applies to decoder-only models, not {cls.kind}"):
        cls(**changes)


def test_the_family_fields_default_to_todays_models_and_round_trip():
    config = DecoderOnlyConfig()
    assert (config.placement, config.qkv_bias, config.rotary_fraction, config.qk_norm) == ("post", None, 1.0, "none")
    assert DecoderOnlyConfig(norm_first=True).placement == "pre"
    assert DecoderOnlyConfig(norm_first=True, norm_placement="sandwich").placement == "sandwich"
    gemma = DecoderOnlyConfig(
        **ROPE,
        norm="rms_one_plus",
        norm_placement="sandwich",
        sliding_window=4,
        sliding_layers=[0],
        local_rope_base=10.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        attention_softcap=50.0,
        final_softcap=30.0,
        query_scale=0.0625,
        qk_norm="head",
        activation="geglu",
    )
    assert DecoderOnlyConfig.from_dict({k: v for k, v in gemma.to_dict().items() if k != "kind"}) == gemma
    assert [gemma.is_local_layer(i) for i in range(2)] == [True, False]


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


def test_a_config_past_the_layer_cap_is_one_config_error_before_anything_is_built() -> None:
    from attnlab.errors import AttnlabError, ConfigError
    from attnlab.nn import DecoderOnlyConfig, EncoderDecoderConfig

    with pytest.raises(ConfigError, match=r"model.layers: 1,000,000,000,000 layers, more than the cap of 1,024"):
        DecoderOnlyConfig(vocab_size=10, layers=10**12)
    with pytest.raises(ConfigError, match=r"model.decoder_layers: 2,000 layers"):
        EncoderDecoderConfig(vocab_size=10, decoder_layers=2000)
    with pytest.raises(AttnlabError, match="d_model: 30 is not divisible by heads=4"):  # every check: an AttnlabError
        DecoderOnlyConfig(vocab_size=10, d_model=30, heads=4)
