"""Hugging Face's causal language models mapped onto attnlab's own decoder: their configs and their weights.

Each family of causal language models on the Hub is a choice among the variants attnlab's core
implements (:mod:`attnlab.nn.config`): where the norms sit, which norm, which activation, which
positions, which biases. A :class:`~attnlab.pretrained.layout.Family` in the registry
:data:`FAMILIES` (keyed by config.json's ``model_type``) says two things, and nothing else: its
config.json as the ``[model]`` section of an attnlab ``decoder_only`` config, and its tensors'
:data:`~attnlab.pretrained.layout.Layout` (:mod:`attnlab.pretrained.layout`, which also fills the
model from them). A GGUF file of a Llama model is opened through the ``llama`` family, its names
renamed to Hugging Face's first (:mod:`attnlab.pretrained.gguf`); the encoders (BERT, RoBERTa) are
in :mod:`attnlab.pretrained.encoder_families`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab.errors import ConfigError
from attnlab.nn.rotary import ROPE_SCALINGS
from attnlab.pretrained.config_checks import rope_settings
from attnlab.pretrained.layout import Family, Layout, Piece

__all__ = ["FAMILIES", "family_of", "STACK"]

STACK = "decoder"
"""The attribute of :class:`attnlab.nn.DecoderOnly` that holds its embedding and layers."""


# ---- reading config.json ---------------------------------------------------------------------------


def _get(hf: Mapping[str, Any], key: str, where: Path, kind: type | tuple[type, ...] = int, default: Any = ...) -> Any:
    value = hf.get(key, default)
    if value is ...:
        raise ConfigError(f"{where}: '{key}' is missing")
    if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"{where}: '{key}' must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def _real(hf: Mapping[str, Any], key: str, where: Path, default: Any = ...) -> float | None:
    value = _get(hf, key, where, (int, float), default)
    return None if value is None else float(value)


def _require(hf: Mapping[str, Any], key: str, allowed: Iterable[Any], where: Path, default: Any = None) -> Any:
    """``hf[key]`` where it is one of ``allowed``; else one error naming the key and what attnlab implements."""
    value = hf.get(key, default)
    allowed = tuple(allowed)
    if value not in allowed:
        raise ConfigError(
            f"{where}: {key} = {value!r} is not implemented by attnlab; supported: {', '.join(map(repr, allowed))}"
        )
    return value


def _rope_parameters(hf: Mapping[str, Any], where: Path, layer_type: str = "full_attention") -> Mapping[str, Any]:
    """The rotary settings of ``layer_type``'s layers as transformers 5 reads them: ``rope_parameters``
    (per layer type for Gemma 3), replaced by a legacy ``rope_scaling`` where one is given, with the
    top-level ``rope_theta`` filling in (:func:`attnlab.pretrained.config_checks.rope_settings`)."""
    return rope_settings(hf, where, layer_type=layer_type)


def _rope_base(
    hf: Mapping[str, Any], where: Path, layer_type: str = "full_attention", default: float = 10000.0
) -> float:
    base = _rope_parameters(hf, where, layer_type).get("rope_theta", default)
    if isinstance(base, bool) or not isinstance(base, (int, float)):
        raise ConfigError(f"{where}: rope_theta must be a number, got {base!r}")
    return float(base)


def _rope_scaling(hf: Mapping[str, Any], where: Path) -> dict[str, Any] | None:
    scaling = _rope_parameters(hf, where)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    supported = [name for name in ROPE_SCALINGS if name != "default"]
    if kind not in supported:
        raise ConfigError(
            f"{where}: rope_scaling type {kind!r} is not implemented by attnlab; supported: {', '.join(supported)}"
        )
    return {key: value for key, value in scaling.items() if key != "rope_theta"}


def _rotary_fraction(hf: Mapping[str, Any], where: Path, default: float) -> float:
    """The rotated share of each head: ``partial_rotary_factor`` (in ``rope_parameters`` since
    transformers 5, else at the top level) or GPT-NeoX's ``rotary_pct``."""
    for value in (
        _rope_parameters(hf, where).get("partial_rotary_factor"),
        hf.get("partial_rotary_factor"),
        hf.get("rotary_pct"),
    ):
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}: partial_rotary_factor must be a number, got {value!r}")
            return float(value)
    return default


def _core(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """The sizes every family shares, under Llama's key names."""
    d_model = _get(hf, "hidden_size", where)
    heads = _get(hf, "num_attention_heads", where)
    head_dim = _get(hf, "head_dim", where, default=None)
    section: dict[str, Any] = {
        "kind": "decoder_only",
        "layers": _get(hf, "num_hidden_layers", where),
        "d_model": d_model,
        "heads": heads,
        "kv_heads": _get(hf, "num_key_value_heads", where, default=None) or heads,
        "d_ff": _get(hf, "intermediate_size", where),
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "positional": "rope",
        "rope_base": _rope_base(hf, where),
        "max_len": _get(hf, "max_position_embeddings", where, default=2048),
        "activation": "swiglu",
        "norm": "rms",
        "norm_first": True,
        "layer_norm_eps": _real(hf, "rms_norm_eps", where, default=1e-6),
        "scale_embeddings": False,
        "bias": False,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
    }
    if head_dim is not None and head_dim * heads != d_model:
        section["d_k"] = section["d_v"] = head_dim
    scaling = _rope_scaling(hf, where)
    if scaling is not None:
        section["rope_scaling"] = scaling
    return section


def _no_window(hf: Mapping[str, Any], where: Path) -> None:
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise ConfigError(f"{where}: use_sliding_window = true is not implemented by attnlab for this family")


# ---- the families ------------------------------------------------------------------------------------


def _llama_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), where, default="silu")
    section = _core(hf, where)
    attention_bias = bool(hf.get("attention_bias", False))
    if bool(hf.get("mlp_bias", False)) != attention_bias:
        raise ConfigError(f"{where}: attention_bias and mlp_bias differ, which attnlab does not implement")
    section["bias"] = attention_bias
    return section


def _mistral_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    section = _llama_section(hf, where)
    window = _get(hf, "sliding_window", where, default=None)
    if window is not None and window < section["max_len"]:
        section["sliding_window"] = window
    return section


def _qwen2_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), where, default="silu")
    _no_window(hf, where)
    section = _core(hf, where)
    section["qkv_bias"] = True  # Qwen2: biases on q, k and v only
    return section


def _qwen3_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), where, default="silu")
    _no_window(hf, where)
    section = _core(hf, where)
    section["qk_norm"] = "head"
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias = true is not implemented by attnlab for qwen3")
    return section


def _olmo2_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), where, default="silu")
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias = true is not implemented by attnlab for olmo2")
    section = _core(hf, where)
    section["qk_norm"] = "full"
    section["norm_placement"] = "output"
    return section


def _phi3_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("silu",), where, default="silu")
    section = _core(hf, where)
    fraction = _rotary_fraction(hf, where, default=1.0)
    if fraction != 1.0:
        section["rotary_fraction"] = fraction
    window = _get(hf, "sliding_window", where, default=None)
    if window is not None and window < section["max_len"]:
        section["sliding_window"] = window
    return section


def _gemma_common(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ConfigError(
            f"{where}: hidden_activation = {activation!r} is not implemented by attnlab; supported: 'gelu_pytorch_tanh'"
        )
    section = _core(hf, where)
    section |= {
        "activation": "geglu",
        "norm": "rms_one_plus",
        "norm_placement": "sandwich",
        "scale_embeddings": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }
    scalar = _real(hf, "query_pre_attn_scalar", where, default=None)
    if scalar is not None:
        section["query_scale"] = scalar**-0.5
    for theirs, ours in (("attn_logit_softcapping", "attention_softcap"), ("final_logit_softcapping", "final_softcap")):
        cap = _real(hf, theirs, where, default=None)
        if cap is not None:
            section[ours] = cap
    if hf.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias = true is not implemented by attnlab for gemma")
    return section


def _local_layers(hf: Mapping[str, Any], where: Path, default_pattern: int) -> list[int]:
    layers = _get(hf, "num_hidden_layers", where)
    types = hf.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return [i for i, kind in enumerate(types) if kind == "sliding_attention"]
    pattern = _get(hf, "sliding_window_pattern", where, default=default_pattern)
    return [i for i in range(layers) if (i + 1) % pattern]


def _gemma2_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    section = _gemma_common(hf, where)
    window = _get(hf, "sliding_window", where, default=None)
    if window is not None:
        section["sliding_window"] = window
        section["sliding_layers"] = _local_layers(hf, where, default_pattern=2)  # even layers: local
    return section


def _gemma3_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    section = _gemma_common(hf, where)
    section["qk_norm"] = "head"
    window = _get(hf, "sliding_window", where, default=None)
    if window is not None:
        section["sliding_window"] = window
        section["sliding_layers"] = _local_layers(hf, where, default_pattern=6)
        local = _real(hf, "rope_local_base_freq", where, default=None)
        section["local_rope_base"] = local if local is not None else _rope_base(hf, where, "sliding_attention")
    return section


def _gpt2_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where, default="gelu_new")
    for key in ("scale_attn_by_inverse_layer_idx", "add_cross_attention"):
        if hf.get(key):
            raise ConfigError(f"{where}: {key} = true is not implemented by attnlab")
    if hf.get("scale_attn_weights") is False:
        raise ConfigError(f"{where}: scale_attn_weights = false is not implemented by attnlab")
    d_model = _get(hf, "n_embd", where)
    return _gpt2_like(hf, where, d_model, _get(hf, "n_layer", where), _get(hf, "n_head", where)) | {
        "d_ff": _get(hf, "n_inner", where, default=None) or 4 * d_model,
        "max_len": _get(hf, "n_positions", where, default=1024),
    }


def _gpt2_like(hf: Mapping[str, Any], where: Path, d_model: int, layers: int, heads: int) -> dict[str, Any]:
    """GPT-2's layers (learned positions, pre-LN LayerNorm, tanh GELU, biases): GPT-2 and GPT-Neo."""
    return {
        "kind": "decoder_only",
        "layers": layers,
        "d_model": d_model,
        "heads": heads,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "positional": "learned",
        "activation": "gelu_tanh",
        "norm": "layer",
        "norm_first": True,
        "layer_norm_eps": _real(hf, "layer_norm_epsilon", where, default=1e-5),
        "scale_embeddings": False,
        "bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _gpt_neo_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """GPT-Neo: GPT-2's layers without the score scale (q.k as it is), separate q/k/v maps without
    biases, and local attention (a window of ``window_size`` keys) in the layers ``attention_layers`` says."""
    _require(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where, default="gelu_new")
    d_model, layers = _get(hf, "hidden_size", where), _get(hf, "num_layers", where)
    kinds = hf.get("attention_layers") or []
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {"global", "local"}:
        raise ConfigError(f"{where}: attention_layers must list 'global' or 'local' for each of the {layers} layers")
    section = _gpt2_like(hf, where, d_model, layers, _get(hf, "num_heads", where)) | {
        "d_ff": _get(hf, "intermediate_size", where, default=None) or 4 * d_model,
        "max_len": _get(hf, "max_position_embeddings", where, default=2048),
        "query_scale": 1.0,
    }
    local = [index for index, kind in enumerate(kinds) if kind == "local"]
    if local:
        section["sliding_window"] = _get(hf, "window_size", where, default=256)
        section["sliding_layers"] = local
    return section


def _bloom_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    """BLOOM: ALiBi (no position embeddings), a LayerNorm on the token embedding, pre-LN layers,
    fused per-head Q, K, V (as GPT-NeoX's), tanh GELU, biases everywhere."""
    if hf.get("apply_residual_connection_post_layernorm"):
        raise ConfigError(f"{where}: apply_residual_connection_post_layernorm = true is not implemented by attnlab")
    d_model = _get(hf, "hidden_size", where)
    return {
        "kind": "decoder_only",
        "layers": _get(hf, "n_layer", where),
        "d_model": d_model,
        "heads": _get(hf, "n_head", where),
        "d_ff": 4 * d_model,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "positional": "alibi",
        "max_len": _get(hf, "seq_length", where, default=2048),
        "activation": "gelu_tanh",
        "norm": "layer",
        "norm_first": True,
        "embedding_norm": True,
        "layer_norm_eps": _real(hf, "layer_norm_epsilon", where, default=1e-5),
        "scale_embeddings": False,
        "bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
    }


def _neox_section(hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
    _require(hf, "hidden_act", ("gelu",), where, default="gelu")
    if hf.get("attention_bias") is False:
        raise ConfigError(f"{where}: attention_bias = false is not implemented by attnlab for gpt_neox")
    section = _core(hf, where)
    section |= {
        "kv_heads": section["heads"],
        "activation": "gelu",
        "norm": "layer",
        "layer_norm_eps": _real(hf, "layer_norm_eps", where, default=1e-5),
        "bias": True,
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "rope_base": _real(hf, "rotary_emb_base", where, default=_rope_base(hf, where)),
    }
    fraction = _rotary_fraction(hf, where, default=0.25)  # GPT-NeoX's own default rotary_pct
    if fraction != 1.0:
        section["rotary_fraction"] = fraction
    if hf.get("use_parallel_residual", True):
        section["parallel_residual"] = True
    return section


# ---- the weights' layouts ------------------------------------------------------------------------------


def _transposed(tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
    """GPT-2's ``Conv1D`` stores W^T, (d_in, d_out); attnlab's maps hold W, (d_out, d_in)."""
    return tensor.t()


def _neox_qkv(tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
    """GPT-NeoX's fused ``query_key_value`` holds, per head h, [q_h; k_h; v_h] (3 d_head rows
    each head); attnlab's ``in_proj`` holds [W_Q; W_K; W_V], heads in order within each."""
    heads = int(hf["num_attention_heads"])
    per_head = tensor.reshape(heads, 3, -1, *tensor.shape[1:])  # (H, 3, d_head, ...)
    return per_head.transpose(0, 1).reshape(tensor.shape)  # (3, H, d_head, ...) -> [Q; K; V]


def _llama_like(
    hf: Mapping[str, Any], tied: bool, *, norms: Mapping[str, str], fused: bool = False, qkv_bias: bool = False
) -> Layout:
    """Llama's names (``model.layers.N.self_attn.q_proj``, ...); ``norms``: attnlab norm -> HF norm
    of each layer; ``fused``: Phi-3's ``qkv_proj`` and ``gate_up_proj``; ``qkv_bias``: Qwen2's biases
    on q, k and v alone (``attention_bias`` puts them on every map)."""
    layout: Layout = {
        f"{STACK}.embedding.token.weight": (Piece("model.embed_tokens.weight"),),
        f"{STACK}.final_norm.weight": (Piece("model.norm.weight"),),
    }
    if not tied:
        layout["lm_head.weight"] = (Piece("lm_head.weight"),)
    bias = bool(hf.get("attention_bias", False))
    qkv_bias = qkv_bias or bias
    for n in range(int(hf["num_hidden_layers"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"model.layers.{n}."
        attn, mlp = theirs + "self_attn.", theirs + "mlp."
        if fused:
            layout[ours + "self_attn.in_proj_weight"] = (Piece(attn + "qkv_proj.weight"),)
            layout[ours + "feed_forward.linear1.weight"] = (Piece(mlp + "gate_up_proj.weight"),)
        else:
            layout[ours + "self_attn.in_proj_weight"] = tuple(Piece(f"{attn}{p}_proj.weight") for p in "qkv")
            layout[ours + "feed_forward.linear1.weight"] = (
                Piece(mlp + "gate_proj.weight"),
                Piece(mlp + "up_proj.weight"),
            )
        if qkv_bias:
            layout[ours + "self_attn.in_proj_bias"] = tuple(Piece(f"{attn}{p}_proj.bias") for p in "qkv")
        layout[ours + "self_attn.out_proj.weight"] = (Piece(attn + "o_proj.weight"),)
        layout[ours + "feed_forward.linear2.weight"] = (Piece(mlp + "down_proj.weight"),)
        if bias:
            layout[ours + "self_attn.out_proj.bias"] = (Piece(attn + "o_proj.bias"),)
            layout[ours + "feed_forward.linear1.bias"] = (Piece(mlp + "gate_proj.bias"), Piece(mlp + "up_proj.bias"))
            layout[ours + "feed_forward.linear2.bias"] = (Piece(mlp + "down_proj.bias"),)
        for mine, hf_norm in norms.items():
            layout[f"{ours}{mine}.weight"] = (Piece(f"{theirs}{hf_norm}.weight"),)
    return layout


_LLAMA_NORMS = {"attn_norm.norm": "input_layernorm", "ffn_norm.norm": "post_attention_layernorm"}
_QK_NORMS = {"self_attn.q_norm": "self_attn.q_norm", "self_attn.k_norm": "self_attn.k_norm"}
_SANDWICH_NORMS = {
    "attn_norm.norm": "input_layernorm",
    "attn_norm.post_norm": "post_attention_layernorm",
    "ffn_norm.norm": "pre_feedforward_layernorm",
    "ffn_norm.post_norm": "post_feedforward_layernorm",
}
_OLMO2_NORMS = {
    "attn_norm.norm": "post_attention_layernorm",
    "ffn_norm.norm": "post_feedforward_layernorm",
    **_QK_NORMS,
}


def _gpt2_like_ends(tied: bool) -> Layout:
    """GPT-2's and GPT-Neo's embeddings, final norm and output layer (``transformer.wte``, ...)."""
    layout: Layout = {
        f"{STACK}.embedding.token.weight": (Piece("transformer.wte.weight"),),
        f"{STACK}.embedding.positional.table.weight": (Piece("transformer.wpe.weight"),),
        f"{STACK}.final_norm.weight": (Piece("transformer.ln_f.weight"),),
        f"{STACK}.final_norm.bias": (Piece("transformer.ln_f.bias"),),
    }
    if not tied:
        layout["lm_head.weight"] = (Piece("lm_head.weight"),)
    return layout


def _gpt2_layout(hf: Mapping[str, Any], tied: bool) -> Layout:
    layout = _gpt2_like_ends(tied)
    pairs = {
        "self_attn.in_proj": "attn.c_attn",
        "self_attn.out_proj": "attn.c_proj",
        "feed_forward.linear1": "mlp.c_fc",
        "feed_forward.linear2": "mlp.c_proj",
    }
    norms = {"attn_norm.norm": "ln_1", "ffn_norm.norm": "ln_2"}
    for n in range(int(hf["n_layer"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"transformer.h.{n}."
        for mine, conv in pairs.items():
            fused = mine == "self_attn.in_proj"  # nn.MultiheadAttention's names: in_proj_weight, in_proj_bias
            weight, bias = (f"{mine}_weight", f"{mine}_bias") if fused else (f"{mine}.weight", f"{mine}.bias")
            layout[ours + weight] = (Piece(f"{theirs}{conv}.weight", _transposed),)
            layout[ours + bias] = (Piece(f"{theirs}{conv}.bias"),)
        for mine, ln in norms.items():
            for p in ("weight", "bias"):
                layout[f"{ours}{mine}.{p}"] = (Piece(f"{theirs}{ln}.{p}"),)
    return layout


def _gpt_neo_layout(hf: Mapping[str, Any], tied: bool) -> Layout:
    layout = _gpt2_like_ends(tied)
    for n in range(int(hf["num_layers"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"transformer.h.{n}."
        attention = theirs + "attn.attention."
        layout[ours + "self_attn.in_proj_weight"] = tuple(Piece(f"{attention}{m}_proj.weight") for m in "qkv")
        layout[ours + "self_attn.out_proj.weight"] = (Piece(attention + "out_proj.weight"),)
        layout[ours + "self_attn.out_proj.bias"] = (Piece(attention + "out_proj.bias"),)
        for mine, linear in (("linear1", "c_fc"), ("linear2", "c_proj")):
            for p in ("weight", "bias"):
                layout[f"{ours}feed_forward.{mine}.{p}"] = (Piece(f"{theirs}mlp.{linear}.{p}"),)
        for mine, ln in (("attn_norm.norm", "ln_1"), ("ffn_norm.norm", "ln_2")):
            for p in ("weight", "bias"):
                layout[f"{ours}{mine}.{p}"] = (Piece(f"{theirs}{ln}.{p}"),)
    return layout


def _bloom_layout(hf: Mapping[str, Any], tied: bool) -> Layout:
    layout: Layout = {
        f"{STACK}.embedding.token.weight": (Piece("transformer.word_embeddings.weight"),),
        f"{STACK}.embedding.norm.weight": (Piece("transformer.word_embeddings_layernorm.weight"),),
        f"{STACK}.embedding.norm.bias": (Piece("transformer.word_embeddings_layernorm.bias"),),
        f"{STACK}.final_norm.weight": (Piece("transformer.ln_f.weight"),),
        f"{STACK}.final_norm.bias": (Piece("transformer.ln_f.bias"),),
    }
    if not tied:
        layout["lm_head.weight"] = (Piece("lm_head.weight"),)
    heads = {"num_attention_heads": hf["n_head"]}
    for n in range(int(hf["n_layer"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"transformer.h.{n}."
        for p in ("weight", "bias"):
            fused = Piece(f"{theirs}self_attention.query_key_value.{p}", lambda t, hf, heads=heads: _neox_qkv(t, heads))
            layout[f"{ours}self_attn.in_proj_{p}"] = (fused,)
            layout[f"{ours}self_attn.out_proj.{p}"] = (Piece(f"{theirs}self_attention.dense.{p}"),)
            layout[f"{ours}feed_forward.linear1.{p}"] = (Piece(f"{theirs}mlp.dense_h_to_4h.{p}"),)
            layout[f"{ours}feed_forward.linear2.{p}"] = (Piece(f"{theirs}mlp.dense_4h_to_h.{p}"),)
            layout[f"{ours}attn_norm.norm.{p}"] = (Piece(f"{theirs}input_layernorm.{p}"),)
            layout[f"{ours}ffn_norm.norm.{p}"] = (Piece(f"{theirs}post_attention_layernorm.{p}"),)
    return layout


def _neox_layout(hf: Mapping[str, Any], tied: bool) -> Layout:
    layout: Layout = {
        f"{STACK}.embedding.token.weight": (Piece("gpt_neox.embed_in.weight"),),
        f"{STACK}.final_norm.weight": (Piece("gpt_neox.final_layer_norm.weight"),),
        f"{STACK}.final_norm.bias": (Piece("gpt_neox.final_layer_norm.bias"),),
    }
    if not tied:
        layout["lm_head.weight"] = (Piece("embed_out.weight"),)
    for n in range(int(hf["num_hidden_layers"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"gpt_neox.layers.{n}."
        layout[ours + "self_attn.in_proj_weight"] = (Piece(theirs + "attention.query_key_value.weight", _neox_qkv),)
        layout[ours + "self_attn.in_proj_bias"] = (Piece(theirs + "attention.query_key_value.bias", _neox_qkv),)
        pairs = {
            "self_attn.out_proj": "attention.dense",
            "feed_forward.linear1": "mlp.dense_h_to_4h",
            "feed_forward.linear2": "mlp.dense_4h_to_h",
            "attn_norm.norm": "input_layernorm",
            "ffn_norm.norm": "post_attention_layernorm",
        }
        for mine, hf_name in pairs.items():
            for p in ("weight", "bias"):
                layout[f"{ours}{mine}.{p}"] = (Piece(f"{theirs}{hf_name}.{p}"),)
    return layout


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "llama",
            _llama_section,
            lambda hf, tied: _llama_like(hf, tied, norms=_LLAMA_NORMS),
            ("*.rotary_emb.inv_freq",),
        ),
        Family("mistral", _mistral_section, lambda hf, tied: _llama_like(hf, tied, norms=_LLAMA_NORMS)),
        Family("qwen2", _qwen2_section, lambda hf, tied: _llama_like(hf, tied, norms=_LLAMA_NORMS, qkv_bias=True)),
        Family("qwen3", _qwen3_section, lambda hf, tied: _llama_like(hf, tied, norms={**_LLAMA_NORMS, **_QK_NORMS})),
        Family("olmo2", _olmo2_section, lambda hf, tied: _llama_like(hf, tied, norms=_OLMO2_NORMS)),
        Family("phi3", _phi3_section, lambda hf, tied: _llama_like(hf, tied, norms=_LLAMA_NORMS, fused=True)),
        Family("gemma2", _gemma2_section, lambda hf, tied: _llama_like(hf, tied, norms=_SANDWICH_NORMS)),
        Family(
            "gemma3_text",
            _gemma3_section,
            lambda hf, tied: _llama_like(hf, tied, norms={**_SANDWICH_NORMS, **_QK_NORMS}),
        ),
        Family("gpt2", _gpt2_section, _gpt2_layout, ("*.attn.bias", "*.attn.masked_bias"), ("lm_head.bias",)),
        Family(
            "gpt_neo",
            _gpt_neo_section,
            _gpt_neo_layout,
            ("*.attn.attention.bias", "*.attn.attention.masked_bias"),
            ("lm_head.bias", f"{STACK}.layers.*.self_attn.in_proj_bias"),
        ),
        Family("bloom", _bloom_section, _bloom_layout, (), ("lm_head.bias",)),
        Family(
            "gpt_neox",
            _neox_section,
            _neox_layout,
            ("*.attention.bias", "*.attention.masked_bias", "*.attention.rotary_emb.inv_freq"),
            ("lm_head.bias",),
        ),
    )
}
"""Registry of the Hugging Face ``model_type`` values attnlab opens as its own decoder, each a
:class:`~attnlab.pretrained.layout.Family`."""


def family_of(hf: Mapping[str, Any], where: Path) -> Family:
    """The family of config.json ``hf``; one ConfigError naming the ``model_type`` and the supported ones."""
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not implemented by attnlab; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]
