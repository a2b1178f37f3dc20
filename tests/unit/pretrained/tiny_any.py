"""A tiny random model of any causal-LM type transformers knows, and the checks of attnlab's
bridge against it (float64): the test data and the checks of tests/unit/pretrained/test_bridge.py,
and of tools/bridge_coverage.py, which writes docs/pretrained.md's table from the same checks.

Each config class is built with small sizes passed to its constructor (so the values it derives,
such as its layer types, follow them) under every name families use for them; the tokenizer is
tiny_hf's byte-level BPE, its vocabulary 320."""

from __future__ import annotations

import contextlib
import io
import warnings
from pathlib import Path
from typing import Any

import torch

from tests.unit.pretrained.tiny_hf import save_tokenizer

VOCAB = 320
SMALL: dict[str, Any] = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 48,
    "head_dim": 8,
    "max_position_embeddings": 64,
    # the names some families use for the same sizes
    "n_embd": 32,
    "n_layer": 2,
    "n_head": 4,
    "n_positions": 64,
    "n_inner": 48,
    "d_model": 32,
    "num_layers": 2,
    "num_heads": 4,
    "ffn_dim": 48,
    "ffn_hidden_size": 48,
    "multi_query_group_num": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "decoder_ffn_dim": 48,
    "encoder_ffn_dim": 48,
    "kv_channels": 8,
    "seq_length": 64,
    "max_seq_len": 64,
    "embed_dim": 32,
    "word_embed_proj_dim": 32,
    # mixtures of experts: few and small
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "moe_num_experts": 4,
    "moe_topk": 2,
    # low-rank attention (DeepSeek V2/V3): small ranks
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    # windows shorter than nothing the tests run
    "sliding_window": 64,
    "tie_word_embeddings": False,
    "is_decoder": True,  # a causal LM of an encoder family (BertGeneration, RoBERTa) attends causally
    "vocab_size": VOCAB,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "gptj": {"rotary_dim": 4},
    "codegen": {"rotary_dim": 4},
}
"""Sizes a family spells its own way."""


def causal_types() -> list[str]:
    """Every ``model_type`` of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def build_any(model_type: str, folder: Path, *, seed: int = 0) -> Any:
    """A random transformers causal LM of ``model_type`` with tiny sizes, saved into ``folder``
    (with tokenizer.json); returned in float64 with transformers' eager attention."""
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    save_tokenizer(folder)
    config_class = CONFIG_MAPPING[model_type]
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        config = _config(config_class, {**SMALL, **OVERRIDES.get(model_type, {})})
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        if text is not config:
            for key, value in SMALL.items():
                with contextlib.suppress(Exception):
                    setattr(text, key, value)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
        with contextlib.suppress(Exception):  # grouped_mm, the experts' default, computes no float64
            model.set_experts_implementation("eager")
        with torch.no_grad():
            for parameter in model.parameters():
                if parameter.dim() == 1:  # norms' gains and biases, away from 1 and 0
                    parameter.add_(torch.randn_like(parameter) * 0.2)
        model.save_pretrained(folder)
    return model.double().eval()


def _config(config_class: Any, sizes: dict[str, Any]) -> Any:
    """``config_class(**sizes)``, leaving out the keys it refuses (a derived property, say), one by one."""
    sizes = dict(sizes)
    for _ in range(len(sizes)):
        try:
            return config_class(**sizes)
        except (AttributeError, TypeError, ValueError) as error:
            refused = [key for key in sizes if f"'{key}'" in str(error) or f"`{key}`" in str(error)]
            if not refused:
                raise
            del sizes[refused[0]]
    return config_class(**sizes)


def ids(batch: int = 2, length: int = 7, *, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


def check_bridged(reference: Any, lm: Any) -> None:
    """The bridged model ``lm`` (``attnlab.load`` of the folder, float64) against transformers'
    ``reference`` (eager, float64): logits, every layer's pattern, masking one head, KV-cached
    greedy generation. An AssertionError names the first check that fails."""
    from attnlab.generate.search import DecodeOptions, generate_continuations
    from attnlab.nn import masking_heads

    tokens = ids()
    with torch.no_grad():
        expected = reference(tokens, output_attentions=True, use_cache=False)
        sites = [s for s in lm.model.decoder.layers if s.self_attn is not None]
        with lm.trace("decoder.*.attn.pattern") as traced:
            logits = lm(tokens)
    scale = float(expected.logits.abs().max())
    error = float((logits - expected.logits).abs().max())
    assert error <= 1e-6 * scale, f"logits differ by {error:.2e} (largest logit {scale:.2e})"
    assert torch.equal(logits.argmax(-1), expected.logits.argmax(-1)), "argmax differs"
    patterns = [a for a in (expected.attentions or ()) if a is not None]
    assert len(patterns) == len(sites), f"{len(patterns)} patterns from transformers, {len(sites)} attention layers"
    names = [n for n in traced.cache if n.endswith(".attn.pattern")]
    for name, pattern in zip(names, patterns):
        mine = traced.cache[name]
        assert mine.shape == pattern.shape, f"{name}: shape {tuple(mine.shape)}, transformers {tuple(pattern.shape)}"
        gap = float((mine - pattern).abs().max())
        assert gap <= 1e-6, f"{name} differs from transformers' eager attentions by {gap:.2e}"
    _check_head_mask(reference, lm, tokens)
    prompt = tokens[:1, :5]
    with torch.no_grad():
        wanted = reference.generate(prompt, max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=2)
    got = generate_continuations(
        lm.model, [prompt[0].tolist()], eos_id=-1, banned=(), options=DecodeOptions(max_length=6)
    )[0].tokens
    assert got == wanted[0, 5:].tolist(), f"cached greedy generation {got} != transformers' {wanted[0, 5:].tolist()}"


def _check_head_mask(reference: Any, lm: Any, tokens: torch.Tensor) -> None:
    """xi_(L,h) = 0 equals zeroing head h's slice of W^O's input in transformers' model."""
    from attnlab.nn import masking_heads

    layers = lm.model.decoder.layers
    index = max(i for i, layer in enumerate(layers) if layer.self_attn is not None)
    attention = layers[index].self_attn
    if attention.output is None:
        raise AssertionError(f"layer {index}: no output projection W^O found")
    head = attention.heads - 1
    names = {module: name for name, module in lm.model.hf.named_modules()}
    projection = dict(reference.named_modules())[names[attention.output]]
    width = attention.d_v

    def zero_head(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0].clone()
        x[..., head * width : (head + 1) * width] = 0
        return (x, *args[1:])

    handle = projection.register_forward_pre_hook(zero_head)
    try:
        with torch.no_grad():
            expected = reference(tokens, use_cache=False).logits
    finally:
        handle.remove()
    xi = lm.head_mask()
    xi["self"][index, head] = 0.0
    with torch.no_grad(), masking_heads(lm.model, xi):
        masked = lm(tokens)
    scale = float(expected.abs().max())
    error = float((masked - expected).abs().max())
    assert error <= 1e-6 * scale, f"masking head {index}:{head} differs by {error:.2e}"
