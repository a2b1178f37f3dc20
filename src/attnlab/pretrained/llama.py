"""A Llama-family decoder as an attnlab ``DecoderOnly`` model: its config and its weights.

Llama (Touvron et al. 2023) is the decoder-only Transformer with four choices, all attnlab config
options (:mod:`attnlab.nn.config`):

* pre-norm blocks with RMSNorm, x + Sublayer(RMSNorm(x)), and a final RMSNorm;
* rotary positions on queries and keys (:mod:`attnlab.nn.rotary`), none added to the input;
* grouped-query attention: H query heads share H_kv key/value heads;
* a SwiGLU FFN, (SiLU(x W_gate) * x W_up) W_down, and no bias in any linear map.

Hugging Face's ``LlamaForCausalLM`` names the weights ``model.layers.{i}.self_attn.q_proj.weight``
and so on; :func:`convert_llama_state` maps them onto attnlab's modules: W_Q, W_K, W_V stacked
into ``in_proj_weight`` (head h of each in rows h*d:(h+1)*d, as Llama splits them into heads),
W_gate and W_up stacked into the FFN's first map. :func:`llama_model_section` gives the
``[model]`` section of an attnlab config for given hyperparameters.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import CheckpointError

__all__ = ["llama_model_section", "fill_llama_state", "convert_llama_state"]


def llama_model_section(
    *,
    layers: int,
    d_model: int,
    heads: int,
    kv_heads: int,
    d_ff: int,
    rms_eps: float,
    rope_base: float,
    context_length: int,
    tied_embeddings: bool = True,
) -> dict[str, Any]:
    """The ``[model]`` section of a Llama-family decoder (every value that differs from the
    defaults); the vocabulary size and padding id come from the task, as for every model."""
    return {
        "kind": "decoder_only",
        "layers": layers,
        "d_model": d_model,
        "heads": heads,
        "kv_heads": kv_heads,
        "d_ff": d_ff,
        "dropout": 0.0,
        "attention_dropout": 0.0,
        "positional": "rope",
        "rope_base": float(rope_base),
        "max_len": context_length,
        "activation": "swiglu",
        "norm": "rms",
        "norm_first": True,
        "layer_norm_eps": float(rms_eps),
        "scale_embeddings": False,
        "bias": False,
        "tie_embeddings": tied_embeddings,
    }


def _layer_rules(layer: int) -> dict[str, tuple[str, ...]]:
    """attnlab name -> the Hugging Face names stacked (in order) into it, for one block."""
    ours, theirs = f"decoder.layers.{layer}.", f"model.layers.{layer}."
    return {
        ours + "self_attn.in_proj_weight": tuple(
            theirs + f"self_attn.{name}_proj.weight" for name in ("q", "k", "v")
        ),  # [W_Q; W_K; W_V]
        ours + "self_attn.out_proj.weight": (theirs + "self_attn.o_proj.weight",),
        ours + "feed_forward.linear1.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
        ours + "feed_forward.linear2.weight": (theirs + "mlp.down_proj.weight",),
        ours + "attn_norm.norm.weight": (theirs + "input_layernorm.weight",),
        ours + "ffn_norm.norm.weight": (theirs + "post_attention_layernorm.weight",),
    }


def _layout(layers: int, untied_head: bool) -> dict[str, tuple[str, ...]]:
    """attnlab name -> the Hugging Face names stacked (along dim 0, in order) into it."""
    rules: dict[str, tuple[str, ...]] = {
        "decoder.embedding.token.weight": ("model.embed_tokens.weight",),
        "decoder.final_norm.weight": ("model.norm.weight",),
    }
    if untied_head:
        rules["lm_head.weight"] = ("lm_head.weight",)
    for layer in range(layers):
        rules |= _layer_rules(layer)
    return rules


def fill_llama_state(
    sources: Iterable[tuple[str, Tensor]],
    expected: Mapping[str, Tensor],
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool,
    where: str | Path,
) -> dict[str, Tensor]:
    """attnlab's state dict from Hugging Face Llama tensors that arrive one at a time.

    Each of attnlab's tensors is allocated once and each source is copied into its rows as it
    arrives, so an import holds every weight once (and one source at a time besides).

    Args:
        sources: (Hugging Face name, tensor) pairs; ``lm_head.weight`` only when not tied.
        expected: the attnlab model's state dict, or the same on the meta device (names, shapes).
        layers: the number of blocks.
        heads, kv_heads: query and key/value heads (they fix where W_K and W_V go in ``in_proj_weight``).
        tied: the output layer is the token embedding (no ``lm_head.weight`` among the sources).
        where: the file the tensors came from, for errors.

    Raises:
        CheckpointError: a tensor missing, unknown, repeated, or of the wrong shape, named with ``where``.
    """
    rules = _layout(layers, untied_head=not tied)
    place: dict[str, tuple[str, int]] = {}  # source -> (attnlab name, first row)
    for ours, names in rules.items():
        for name, first in zip(names, _first_rows(ours, expected[ours].shape[0], heads, kv_heads), strict=False):
            place[name] = (ours, first)
    state = {ours: torch.empty(expected[ours].shape, dtype=torch.float32) for ours in rules}
    seen: set[str] = set()
    for name, tensor in sources:
        if name not in place or name in seen:
            what = "repeated" if name in seen else "not part of a Llama model attnlab implements"
            raise CheckpointError(f"{where}: tensor {name!r} is {what}")
        ours, first = place[name]
        target = state[ours].narrow(0, first, tensor.shape[0]) if tensor.dim() else state[ours]
        if tensor.shape[1:] != target.shape[1:] or first + tensor.shape[0] > state[ours].shape[0]:
            raise CheckpointError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, which does not fit {ours} "
                f"{tuple(state[ours].shape)}"
            )
        target.copy_(tensor)
        seen.add(name)
    missing = sorted(set(place) - seen)
    if missing:
        raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing")
    if tied:
        state["lm_head.weight"] = state["decoder.embedding.token.weight"]  # tied
    return state


def _first_rows(ours: str, rows: int, heads: int, kv_heads: int) -> tuple[int, ...]:
    """Where each stacked source starts in attnlab's tensor ``ours`` of ``rows`` rows."""
    if ours.endswith("in_proj_weight"):  # [W_Q; W_K; W_V]: (H + 2 H_kv) d rows
        d = rows // (heads + 2 * kv_heads)
        return (0, heads * d, (heads + kv_heads) * d)
    if ours.endswith("linear1.weight"):  # [W_gate; W_up], d_ff rows each
        return (0, rows // 2)
    return (0,)


def convert_llama_state(
    tensors: Mapping[str, Tensor],
    expected: Mapping[str, Tensor],
    *,
    layers: int,
    heads: int,
    kv_heads: int,
    tied: bool,
    where: str | Path,
) -> dict[str, Tensor]:
    """attnlab's state dict from a mapping of Hugging Face Llama tensors (see :func:`fill_llama_state`)."""
    return fill_llama_state(
        tensors.items(), expected, layers=layers, heads=heads, kv_heads=kv_heads, tied=tied, where=where
    )
