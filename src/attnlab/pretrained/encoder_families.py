"""BERT and RoBERTa checkpoints (Hugging Face layout) mapped onto attnlab's encoder: their configs and their weights.

BERT is the encoder of Vaswani §3.1 with four choices, all of them attnlab config options:

* post-LN layers, LayerNorm(x + Sublayer(x)) with BERT's ``layer_norm_eps`` (Agarwal Def. 6.3);
* a GELU feed-forward network, FFN(x) = GELU(x W_1 + b_1) W_2 + b_2;
* input y_i^(0) = LayerNorm(E[x_i] + P[i] + T[t_i]): learned absolute positions P and token
  types T, no sqrt(d) scaling, then dropout;
* multi-head attention with separate query/key/value maps; attnlab fuses them into
  ``in_proj_weight`` = [W_Q; W_K; W_V], where head h owns rows h*d_k:(h+1)*d_k of each block,
  which is exactly how BERT splits its ``query``/``key``/``value`` outputs into heads
  (Vaswani §3.2.2; Michel §2.2 Eq. 1 writes the same function as a sum over heads).

RoBERTa (Liu et al. 2019) is the same encoder, its position table offset past the padding id.
Each is a :class:`~attnlab.pretrained.layout.Family` in :data:`ENCODER_FAMILIES`, as the decoders
are in :data:`attnlab.pretrained.families.FAMILIES`: config.json -> an ``encoder`` ``[model]``
section (:func:`model_section`), and the ``BertModel``'s tensor names (``embeddings.*``,
``encoder.layer.N.*``) -> attnlab's. A config field that changes the function in a way attnlab
does not implement (relative position embeddings, a decoder, another activation) is a
:class:`ConfigError` that names it. The pooler (and any pre-training head) is not part of the
encoder: the family ignores it. Finding the files and the ``BertModel`` inside a checkpoint is
:mod:`attnlab.pretrained.bert`'s.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torch import Tensor

from attnlab.errors import ConfigError
from attnlab.pretrained.layout import Family, Layout, Piece

__all__ = ["ACTIVATIONS_FROM_HF", "ENCODER_FAMILIES", "STACK", "encoder_family", "model_section", "position_offset"]

STACK = "encoder"
"""The attribute of :class:`attnlab.nn.EncoderOnly` that holds its embedding and layers."""

ACTIVATIONS_FROM_HF = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}
"""Hugging Face ``hidden_act`` -> attnlab activation (``gelu`` is the exact, erf-based GELU)."""


# ---- the config ------------------------------------------------------------------------------------


def model_section(hf: Mapping[str, Any], where: str | Path = "config.json") -> dict[str, Any]:
    """The attnlab ``[model]`` section of a Hugging Face BERT or RoBERTa ``config.json``.

    Args:
        hf: the parsed ``config.json`` (``model_type`` ``bert`` where it names none).
        where: the file it came from, named in errors.

    Raises:
        ConfigError: a missing key, a value of the wrong type or range (``num_attention_heads: 0``),
            or one attnlab does not implement; names the file, the key and its value.
    """
    encoder_family(hf, where)
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ConfigError(
            f"{where}: position_embedding_type {position!r} is not supported; attnlab implements "
            "learned absolute positions only"
        )
    for flag in ("is_decoder", "add_cross_attention"):
        if hf.get(flag):
            raise ConfigError(f"{where}: {flag}=true is not supported; attnlab imports BERT encoders only")
    act = hf.get("hidden_act", "gelu")
    if not isinstance(act, str) or act not in ACTIVATIONS_FROM_HF:
        raise ConfigError(f"{where}: hidden_act {act!r} is not supported; allowed: {', '.join(ACTIVATIONS_FROM_HF)}")
    d_model = _integer(hf, "hidden_size", where)
    embedding_size = hf.get("embedding_size", d_model)
    if embedding_size != d_model:
        raise ConfigError(f"{where}: embedding_size {embedding_size} differs from hidden_size {d_model}; not supported")
    heads = _integer(hf, "num_attention_heads", where)
    if d_model % heads:
        raise ConfigError(f"{where}: hidden_size {d_model} is not divisible by num_attention_heads {heads}")
    return {
        "kind": "encoder",
        "layers": _integer(hf, "num_hidden_layers", where),
        "d_model": d_model,
        "heads": heads,
        "d_ff": _integer(hf, "intermediate_size", where),
        "dropout": _real(hf, "hidden_dropout_prob", where, 0.1, probability=True),
        "attention_dropout": _real(hf, "attention_probs_dropout_prob", where, 0.1, probability=True),
        "attention": "soft",
        "score": "scaled_dot",
        "positional": "learned",
        "positional_combine": "add",
        "max_len": _integer(hf, "max_position_embeddings", where) - position_offset(hf),
        "activation": ACTIVATIONS_FROM_HF[act],
        "norm_first": False,
        "layer_norm_eps": _real(hf, "layer_norm_eps", where, 1e-12),
        "scale_embeddings": False,
        "type_vocab_size": _integer(hf, "type_vocab_size", where, minimum=0, default=2),
        "embedding_norm": True,
        "bias": True,
    }


def encoder_family(hf: Mapping[str, Any], where: str | Path = "config.json") -> Family:
    """The family of config.json ``hf`` (``bert`` where it names no ``model_type``).

    Raises:
        ConfigError: a ``model_type`` that is no encoder family; names it and the supported ones.
    """
    model_type = hf.get("model_type", "bert")
    if model_type not in ENCODER_FAMILIES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not supported; attnlab imports: {', '.join(ENCODER_FAMILIES)}"
        )
    return ENCODER_FAMILIES[model_type]


def position_offset(hf: Mapping[str, Any]) -> int:
    """The first row of the position table a text's first token takes: 0 for BERT; for RoBERTa
    ``pad_token_id + 1`` (its positions count from there, the rows before are never used)."""
    if hf.get("model_type") != "roberta":
        return 0
    pad = hf.get("pad_token_id", 1)
    return pad + 1 if isinstance(pad, int) and not isinstance(pad, bool) and pad >= 0 else 2


def _field(config: Mapping[str, Any], name: str, where: str | Path = "config.json") -> Any:
    if name not in config:
        raise ConfigError(f"{where}: missing {name!r}")
    return config[name]


def _integer(
    config: Mapping[str, Any], name: str, where: str | Path, *, minimum: int = 1, default: int | None = None
) -> int:
    """``config[name]`` as an integer of at least ``minimum`` (``default`` when absent, if given)."""
    value = config.get(name, default) if default is not None else _field(config, name, where)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}: {name} must be an integer >= {minimum}, got {value!r}")
    return value


def _real(
    config: Mapping[str, Any], name: str, where: str | Path, default: float, *, probability: bool = False
) -> float:
    """``config[name]`` as a finite number (``default`` when absent): in [0, 1) for a probability,
    else positive."""
    value = config.get(name, default)
    low, high = (0.0, 1.0) if probability else (0.0, math.inf)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not (low <= value < high)
        or (not probability and value == 0)
    ):
        allowed = "a number in [0, 1)" if probability else "a positive number"
        raise ConfigError(f"{where}: {name} must be {allowed}, got {value!r}")
    return float(value)


# ---- the weights' layout ---------------------------------------------------------------------------


def _past_padding(tensor: Tensor, hf: Mapping[str, Any]) -> Tensor:
    """RoBERTa's position table without its first rows, which belong to no position (:func:`position_offset`)."""
    return tensor[position_offset(hf) :]


def _bert_layout(hf: Mapping[str, Any], tied: bool) -> Layout:
    """``BertModel``'s names (``embeddings.word_embeddings``, ``encoder.layer.N.attention.self.query``,
    ...) -> attnlab's encoder; ``tied`` plays no part (an encoder has no output layer)."""
    positions = "embeddings.position_embeddings.weight"
    layout: Layout = {
        f"{STACK}.embedding.token.weight": (Piece("embeddings.word_embeddings.weight"),),
        f"{STACK}.embedding.positional.table.weight": (
            Piece(positions, _past_padding) if position_offset(hf) else Piece(positions),
        ),
        f"{STACK}.embedding.norm.weight": (Piece("embeddings.LayerNorm.weight"),),
        f"{STACK}.embedding.norm.bias": (Piece("embeddings.LayerNorm.bias"),),
    }
    if hf.get("type_vocab_size", 2):  # the model has token types (model_section checked the value)
        layout[f"{STACK}.embedding.token_type.weight"] = (Piece("embeddings.token_type_embeddings.weight"),)
    pairs = {
        "self_attn.out_proj": "attention.output.dense",
        "attn_norm.norm": "attention.output.LayerNorm",
        "feed_forward.linear1": "intermediate.dense",
        "feed_forward.linear2": "output.dense",
        "ffn_norm.norm": "output.LayerNorm",
    }
    for n in range(int(hf["num_hidden_layers"])):
        ours, theirs = f"{STACK}.layers.{n}.", f"encoder.layer.{n}."
        for p in ("weight", "bias"):
            qkv = tuple(Piece(f"{theirs}attention.self.{m}.{p}") for m in ("query", "key", "value"))
            layout[f"{ours}self_attn.in_proj_{p}"] = qkv  # [W_Q; W_K; W_V]
            for mine, hf_name in pairs.items():
                layout[f"{ours}{mine}.{p}"] = (Piece(f"{theirs}{hf_name}.{p}"),)
    return layout


_HEADS = ("embeddings.position_ids", "pooler.*", "cls.*")
"""Tensors of a ``BertModel`` checkpoint that are no weights of the encoder: a saved buffer, the
pooler, and a pre-training head written without a prefix."""

ENCODER_FAMILIES: dict[str, Family] = {
    name: Family(name, model_section, _bert_layout, ignored=_HEADS) for name in ("bert", "roberta")
}
"""Registry of the Hugging Face ``model_type`` values attnlab opens as its own encoder, each a
:class:`~attnlab.pretrained.layout.Family`."""
