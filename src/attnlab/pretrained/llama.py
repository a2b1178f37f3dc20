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

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from attnlab.errors import CheckpointError

__all__ = ["llama_model_section", "convert_llama_state"]


def llama_model_section(
    *,
    vocab_size: int,
    layers: int,
    d_model: int,
    heads: int,
    kv_heads: int,
    d_ff: int,
    rms_eps: float,
    rope_base: float,
    context_length: int,
    pad_id: int,
    tied_embeddings: bool = True,
) -> dict[str, Any]:
    """The ``[model]`` section of a Llama-family decoder (every value that differs from the defaults)."""
    return {
        "kind": "decoder_only",
        "vocab_size": vocab_size,
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
        "pad_id": pad_id,
        "scale_embeddings": False,
        "bias": False,
        "tie_embeddings": tied_embeddings,
    }


def _layer_rules(layer: int) -> dict[str, tuple[str, ...]]:
    """attnlab name -> the Hugging Face names stacked (in order) into it, for one block."""
    ours, theirs = f"body.layers.{layer}.", f"model.layers.{layer}."
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


def convert_llama_state(
    tensors: Mapping[str, Tensor], expected: Mapping[str, Tensor], *, layers: int, where: str
) -> dict[str, Tensor]:
    """attnlab's state dict from Hugging Face Llama tensors.

    Args:
        tensors: Hugging Face names -> tensors (``lm_head.weight`` only when not tied).
        expected: the attnlab model's own state dict (names and shapes to fill).
        layers: the number of blocks.
        where: the file the tensors came from, for errors.

    Raises:
        CheckpointError: a tensor missing, unused, or of the wrong shape, named with ``where``.
    """
    rules: dict[str, tuple[str, ...]] = {
        "body.embedding.token.weight": ("model.embed_tokens.weight",),
        "body.final_norm.weight": ("model.norm.weight",),
    }
    if "lm_head.weight" in expected and "lm_head.weight" in tensors:
        rules["lm_head.weight"] = ("lm_head.weight",)
    for layer in range(layers):
        rules |= _layer_rules(layer)
    state: dict[str, Tensor] = {}
    for ours, sources in rules.items():
        missing = [name for name in sources if name not in tensors]
        if missing:
            raise CheckpointError(f"{where}: tensor {missing[0]!r} is missing")
        value = torch.cat([tensors[name] for name in sources], dim=0)
        if ours not in expected or value.shape != expected[ours].shape:
            want = tuple(expected[ours].shape) if ours in expected else "nothing"
            raise CheckpointError(f"{where}: {' + '.join(sources)} has shape {tuple(value.shape)}, expected {want}")
        state[ours] = value
    used = {name for sources in rules.values() for name in sources}
    unused = sorted(set(tensors) - used)
    if unused:
        raise CheckpointError(f"{where}: tensor {unused[0]!r} is not part of a Llama model attnlab implements")
    if "lm_head.weight" in expected and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["body.embedding.token.weight"]  # tied
    return state
