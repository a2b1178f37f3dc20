"""The model-family variants of attnlab's core, each against the transformers module that defines
it (its weights copied into attnlab's modules, float64): biases on q, k, v only (Qwen2), partial
rotary and parallel residuals (GPT-NeoX), q/k norms per head (Qwen3) or over the whole projection
(OLMo 2), sliding-window layers (Mistral), and Gemma 2/3's sandwich norms, 1 + w RMSNorm, GeGLU,
soft-capping, query scale, scaled embeddings and local rotary base. The head mask and the named
sites on these variants: tests/unit/nn/test_hooks.py."""

from __future__ import annotations

import pytest
import torch

from attnlab.nn import DecoderOnlyConfig, KVCache, attention_backends, build_model

transformers = pytest.importorskip("transformers")

V, D, HEADS, KV_HEADS, D_FF, LAYERS = 37, 32, 4, 2, 48, 3
COMMON = {"vocab_size": V, "d_model": D, "heads": HEADS, "d_ff": D_FF, "layers": LAYERS, "dropout": 0.0}
LLAMA_LIKE = {
    **COMMON,
    "kv_heads": KV_HEADS,
    "positional": "rope",
    "norm": "rms",
    "norm_first": True,
    "activation": "swiglu",
    "bias": False,
    "scale_embeddings": False,
    "pad_id": 0,
}
HF_COMMON = {
    "vocab_size": V,
    "hidden_size": D,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": D_FF,
    "num_hidden_layers": LAYERS,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

SLOW_WHOLE_MODEL = pytest.mark.slow
"""The whole transformers models of each family, weights copied in: the same functions are compared
in `make test` through the checkpoint files (tests/unit/pretrained/test_hf_families.py), so these
run with `make test-all`."""


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Every parameter drawn at random (norm gains and biases away from 1 and 0)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.3)
            if parameter.dim() == 1 and parameter.shape[0] in (D, D // HEADS, HEADS * D // HEADS):
                parameter.add_(1.0)  # norms' gains near 1, as trained ones are
    return model


def _stack_prefix(model) -> str:
    stack = model.site_stacks()["decoder"][0]
    return next(name for name, module in model.named_modules() if module is stack)


def _copy_llama_like(hf, ours, *, norms: dict[str, str]) -> None:
    """Copies a Llama-layout transformers model into ours; ``norms`` maps a layer's norm names in
    transformers onto ours (which differ by where the family puts them)."""
    prefix = _stack_prefix(ours)
    theirs = hf.state_dict()
    state: dict[str, torch.Tensor] = {
        f"{prefix}.embedding.token.weight": theirs["model.embed_tokens.weight"],
        f"{prefix}.final_norm.weight": theirs["model.norm.weight"],
        "lm_head.weight": theirs["lm_head.weight"],
    }
    for i in range(LAYERS):
        hf_layer, layer = f"model.layers.{i}", f"{prefix}.layers.{i}"
        attn = f"{hf_layer}.self_attn"
        state[f"{layer}.self_attn.in_proj_weight"] = torch.cat([theirs[f"{attn}.{p}_proj.weight"] for p in "qkv"])
        if f"{attn}.q_proj.bias" in theirs:
            state[f"{layer}.self_attn.in_proj_bias"] = torch.cat([theirs[f"{attn}.{p}_proj.bias"] for p in "qkv"])
        state[f"{layer}.self_attn.out_proj.weight"] = theirs[f"{attn}.o_proj.weight"]
        for name in ("q_norm", "k_norm"):
            if f"{attn}.{name}.weight" in theirs:
                state[f"{layer}.self_attn.{name}.weight"] = theirs[f"{attn}.{name}.weight"]
        mlp = f"{hf_layer}.mlp"
        state[f"{layer}.feed_forward.linear1.weight"] = torch.cat(
            [theirs[f"{mlp}.gate_proj.weight"], theirs[f"{mlp}.up_proj.weight"]]
        )
        state[f"{layer}.feed_forward.linear2.weight"] = theirs[f"{mlp}.down_proj.weight"]
        for hf_name, name in norms.items():
            state[f"{layer}.{name}.weight"] = theirs[f"{hf_layer}.{hf_name}.weight"]
    ours.load_state_dict(state, strict=True)


def _compare(hf, ours, *, length: int = 11, seed: int = 0, atol: float = 1e-6) -> None:
    """Logits of a left-padded batch, and KV-cached decoding step by step, equal transformers' in
    float64 (within ``atol`` of the largest logit: transformers takes the softmax and the rotary
    angles in float32). The padded row's reference is transformers on that row without its padding:
    in float64 transformers' own padded rows are NaN (its float32 softmax of a fully masked row)."""
    tokens = torch.randint(1, V, (2, length), generator=torch.Generator().manual_seed(seed))
    is_token = torch.ones(2, length, dtype=torch.bool)
    is_token[1, :3] = False  # left padding
    with torch.no_grad():
        expected = torch.full((2, length, V), float("nan"), dtype=torch.float64)
        expected[:1] = hf(tokens[:1]).logits
        expected[1:, 3:] = hf(tokens[1:, 3:]).logits
        logits = ours(tokens, is_token=is_token)
        tolerance = atol * expected[is_token].abs().max()
        torch.testing.assert_close(logits[is_token], expected[is_token], atol=tolerance, rtol=0)
        assert torch.equal(logits[is_token].argmax(-1), expected[is_token].argmax(-1))
        state = ours.new_state()
        steps = [ours(tokens[:, :4], state=state, is_token=is_token[:, :4])[:, -1]]
        for t in range(4, length):
            steps.append(ours(tokens[:, t : t + 1], state=state, is_token=is_token[:, t : t + 1])[:, -1])
        decoded, full = torch.stack(steps, 1), expected[:, 3:]
        torch.testing.assert_close(decoded[is_token[:, 3:]], full[is_token[:, 3:]], atol=tolerance, rtol=0)


def _hf(config_class, model_class, **options):
    config = config_class(**options)
    config._attn_implementation = "eager"
    return _perturbed(model_class(config), 1).double().eval()


def _ours(**options):
    torch.manual_seed(0)
    return build_model(DecoderOnlyConfig(**options)).double().eval()


LLAMA_NORMS = {"input_layernorm": "attn_norm.norm", "post_attention_layernorm": "ffn_norm.norm"}


@SLOW_WHOLE_MODEL
def test_qwen2_biases_on_q_k_v_only():
    hf = _hf(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, **HF_COMMON, rope_theta=1000.0)
    ours = _ours(**LLAMA_LIKE, qkv_bias=True, rope_base=1000.0, layer_norm_eps=1e-6)
    attn = ours.site_stacks()["decoder"][0].layers[0].self_attn
    assert attn.in_proj_bias is not None and attn.out_proj.bias is None
    assert ours.site_stacks()["decoder"][0].layers[0].feed_forward.linear1.bias is None
    _copy_llama_like(hf, ours, norms=LLAMA_NORMS)
    _compare(hf, ours)


@pytest.mark.parametrize(
    "scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8},
    ],
)
def test_llama_with_scaled_rotary_frequencies(scaling):
    rope_parameters = {**scaling, "rope_theta": 500.0}
    hf = _hf(transformers.LlamaConfig, transformers.LlamaForCausalLM, **HF_COMMON, rope_parameters=rope_parameters)
    ours = _ours(**LLAMA_LIKE, rope_base=500.0, rope_scaling=scaling, layer_norm_eps=1e-6)
    _copy_llama_like(hf, ours, norms=LLAMA_NORMS)
    _compare(hf, ours)


@SLOW_WHOLE_MODEL
def test_gpt_neox_partial_rotary_and_parallel_residuals():
    hf = _hf(
        transformers.GPTNeoXConfig,
        transformers.GPTNeoXForCausalLM,
        vocab_size=V,
        hidden_size=D,
        num_attention_heads=HEADS,
        intermediate_size=D_FF,
        num_hidden_layers=LAYERS,
        max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5},
        tie_word_embeddings=False,
    )
    ours = _ours(
        **COMMON,
        positional="rope",
        rope_base=1000.0,
        rotary_fraction=0.5,
        parallel_residual=True,
        norm_first=True,
        activation="gelu",
        scale_embeddings=False,
    )
    theirs, prefix, d = hf.state_dict(), _stack_prefix(ours), D // HEADS
    state = {
        f"{prefix}.embedding.token.weight": theirs["gpt_neox.embed_in.weight"],
        f"{prefix}.final_norm.weight": theirs["gpt_neox.final_layer_norm.weight"],
        f"{prefix}.final_norm.bias": theirs["gpt_neox.final_layer_norm.bias"],
        "lm_head.weight": theirs["lm_head.weight"],
        "lm_head.bias": torch.zeros(V, dtype=torch.float64),  # GPT-NeoX's output layer has none
    }
    for i in range(LAYERS):
        hf_layer, layer = f"gpt_neox.layers.{i}", f"{prefix}.layers.{i}"
        qkv = f"{hf_layer}.attention.query_key_value"
        # transformers interleaves q, k, v per head: rows (H, 3, d); ours stacks [W^Q; W^K; W^V].
        state[f"{layer}.self_attn.in_proj_weight"] = theirs[f"{qkv}.weight"].view(HEADS, 3, d, D).transpose(0, 1)
        state[f"{layer}.self_attn.in_proj_weight"] = state[f"{layer}.self_attn.in_proj_weight"].reshape(3 * D, D)
        state[f"{layer}.self_attn.in_proj_bias"] = theirs[f"{qkv}.bias"].view(HEADS, 3, d).transpose(0, 1).reshape(-1)
        for hf_name, name in [
            ("attention.dense", "self_attn.out_proj"),
            ("mlp.dense_h_to_4h", "feed_forward.linear1"),
            ("mlp.dense_4h_to_h", "feed_forward.linear2"),
            ("input_layernorm", "attn_norm.norm"),
            ("post_attention_layernorm", "ffn_norm.norm"),
        ]:
            for p in ("weight", "bias"):
                state[f"{layer}.{name}.{p}"] = theirs[f"{hf_layer}.{hf_name}.{p}"]
    ours.load_state_dict(state, strict=True)
    _compare(hf, ours)


@SLOW_WHOLE_MODEL
def test_qwen3_norms_on_each_query_and_key_head():
    hf = _hf(transformers.Qwen3Config, transformers.Qwen3ForCausalLM, **HF_COMMON, head_dim=D // HEADS)
    ours = _ours(**LLAMA_LIKE, qk_norm="head", layer_norm_eps=1e-6)
    attn = ours.site_stacks()["decoder"][0].layers[0].self_attn
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (D // HEADS,)
    _copy_llama_like(hf, ours, norms=LLAMA_NORMS)
    _compare(hf, ours)


OLMO2_NORMS = {"post_attention_layernorm": "attn_norm.norm", "post_feedforward_layernorm": "ffn_norm.norm"}


@SLOW_WHOLE_MODEL
def test_olmo2_norms_on_whole_projections_and_after_the_sublayers():
    hf = _hf(transformers.Olmo2Config, transformers.Olmo2ForCausalLM, **HF_COMMON)
    ours = _ours(**LLAMA_LIKE, qk_norm="full", norm_placement="output", layer_norm_eps=1e-6)
    attn = ours.site_stacks()["decoder"][0].layers[0].self_attn
    assert attn.q_norm.weight.shape == (D,) and attn.k_norm.weight.shape == (KV_HEADS * D // HEADS,)
    _copy_llama_like(hf, ours, norms=OLMO2_NORMS)
    _compare(hf, ours)


@SLOW_WHOLE_MODEL
def test_mistral_sliding_window_attention():
    hf = _hf(transformers.MistralConfig, transformers.MistralForCausalLM, **HF_COMMON, sliding_window=4)
    ours = _ours(**LLAMA_LIKE, sliding_window=4, layer_norm_eps=1e-6)
    _copy_llama_like(hf, ours, norms=LLAMA_NORMS)
    _compare(hf, ours, length=13)
    no_window = _ours(**LLAMA_LIKE, layer_norm_eps=1e-6)
    no_window.load_state_dict(ours.state_dict())
    tokens = torch.randint(1, V, (1, 13))
    with torch.no_grad():
        assert torch.equal(ours(tokens[:, :4]), no_window(tokens[:, :4]))  # within the window: no difference
        assert not torch.allclose(ours(tokens)[:, 4:], no_window(tokens)[:, 4:])  # beyond it, the window cuts


def test_the_window_mask_follows_hugging_faces_boundary_and_a_caches_offset():
    from transformers.masking_utils import and_masks, causal_mask_function, sliding_window_overlay

    from attnlab.nn.masks import sliding_window_mask

    theirs = and_masks(causal_mask_function, sliding_window_overlay(3))
    t = torch.tensor
    expected = torch.tensor([[bool(theirs(t(0), t(0), t(i), t(j))) for j in range(7)] for i in range(7)])
    assert torch.equal(sliding_window_mask(7, 3)[0, 0], expected)
    assert torch.equal(sliding_window_mask(2, 3, 7)[0, 0], expected[5:])  # the last two queries of seven keys


def test_sliding_layers_take_their_own_rotary_base_without_the_scaling():
    scaling = {"rope_type": "linear", "factor": 2.0}
    model = _ours(**LLAMA_LIKE, sliding_window=3, sliding_layers=[0, 2], local_rope_base=10.0, rope_scaling=scaling)
    stack = model.site_stacks()["decoder"][0]
    assert stack.local_layers == [True, False, True]
    rotaries = [layer.self_attn.rotary for layer in stack.layers]
    assert [r.base for r in rotaries] == [10.0, 10000.0, 10.0]
    d = D // HEADS
    plain = 1.0 / (10.0 ** (torch.arange(0, d, 2).float() / d))
    assert torch.equal(rotaries[0].inv_freq.float(), plain)
    assert torch.equal(rotaries[1].inv_freq.float(), 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d)) / 2.0)


GEMMA_NORMS = {
    "input_layernorm": "attn_norm.norm",
    "post_attention_layernorm": "attn_norm.post_norm",
    "pre_feedforward_layernorm": "ffn_norm.norm",
    "post_feedforward_layernorm": "ffn_norm.post_norm",
}
GEMMA_TOLERANCE = 1e-5
"""Of the largest logit: transformers' Gemma norms compute in float32 even on float64 inputs
(``x.float()``), about 1e-6 relative each, four per layer; ours in float64."""
GEMMA_LIKE = {
    **LLAMA_LIKE,
    "norm": "rms_one_plus",
    "norm_placement": "sandwich",
    "activation": "geglu",
    "scale_embeddings": True,
    "layer_norm_eps": 1e-6,
    "query_scale": 16.0**-0.5,
    "sliding_window": 4,
}
HF_GEMMA = {
    **HF_COMMON,
    "head_dim": D // HEADS,
    "query_pre_attn_scalar": 16,
    "sliding_window": 4,
    "hidden_activation": "gelu_pytorch_tanh",
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
}


@SLOW_WHOLE_MODEL
def test_gemma2_sandwich_norms_soft_caps_geglu_query_scale_scaled_embeddings_and_local_layers():
    hf = _hf(
        transformers.Gemma2Config,
        transformers.Gemma2ForCausalLM,
        **HF_GEMMA,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
    )
    ours = _ours(**GEMMA_LIKE, sliding_layers=[0, 2], attention_softcap=2.0, final_softcap=3.0, rope_base=1000.0)
    _copy_llama_like(hf, ours, norms=GEMMA_NORMS)
    _compare(hf, ours, length=13, atol=GEMMA_TOLERANCE)
    with torch.no_grad():
        logits = ours(torch.randint(1, V, (2, 13)))
    assert logits.abs().max() < 3.0 and logits.abs().max() > 2.0  # the cap is what bounds them


@SLOW_WHOLE_MODEL
def test_gemma3_local_rotary_base_scaled_global_layers_and_per_head_q_k_norms():
    scaling = {"rope_type": "linear", "factor": 4.0}
    hf = _hf(
        transformers.Gemma3TextConfig,
        transformers.Gemma3ForCausalLM,
        **HF_GEMMA,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 50.0},
            "full_attention": {**scaling, "rope_theta": 1000.0},
        },
    )
    ours = _ours(
        **GEMMA_LIKE,
        sliding_layers=[0, 2],
        qk_norm="head",
        rope_base=1000.0,
        rope_scaling=scaling,
        local_rope_base=50.0,
    )
    _copy_llama_like(hf, ours, norms=GEMMA_NORMS)
    _compare(hf, ours, length=13, atol=GEMMA_TOLERANCE)


@pytest.mark.parametrize("backend", ["sdpa", "short", "decode", "explicit", None])
@pytest.mark.parametrize("t_q", [1, 6])
def test_soft_capped_scores_take_the_explicit_formula_whatever_the_backend_asked(monkeypatch, backend, t_q):
    """c tanh(scale q.k / c), after the scale and before the mask, on every path: SDPA and attnlab's
    C++ kernels take no score function, so a soft-capped call never reaches them."""
    from attnlab.nn import MultiHeadAttention

    if backend is not None:
        monkeypatch.setattr(attention_backends, "OVERRIDE", backend)
    torch.manual_seed(6)
    mha = MultiHeadAttention(16, 4, kv_heads=2, softcap=0.7, scale=0.5, bias=False).eval()
    x = torch.randn(2, 6, 16) * 3
    with torch.no_grad():
        q, k, v = (x @ mha.in_proj_weight.T).split([16, 8, 8], dim=-1)
        q, k, v = (t.unflatten(-1, (-1, 4)).transpose(1, 2) for t in (q, k, v))
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        scores = 0.7 * torch.tanh(q @ k.transpose(-1, -2) * 0.5 / 0.7)
        scores = scores.masked_fill(~torch.ones(6, 6, dtype=torch.bool).tril(), float("-inf"))
        expected = mha.out_proj(((scores.softmax(-1) @ v).transpose(1, 2)).flatten(2))[:, -t_q:]
        if t_q == 6:
            ours = mha(x, causal=True)
        else:  # one decoding step against a cache of five keys
            cache = KVCache()
            mha(x[:, :5], causal=True, cache=cache)
            ours = mha(x[:, 5:], causal=True, cache=cache)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_the_logits_site_holds_the_capped_logits():
    from attnlab.nn import trace

    ours = _ours(**LLAMA_LIKE, final_softcap=0.5)
    uncapped = _ours(**LLAMA_LIKE)
    uncapped.load_state_dict(ours.state_dict())
    tokens = torch.randint(1, V, (2, 5))
    with torch.no_grad(), trace(ours, cache="logits") as t:
        logits = ours(tokens)
        torch.testing.assert_close(logits, 0.5 * torch.tanh(uncapped(tokens) / 0.5), rtol=1e-14, atol=1e-14)
    assert torch.equal(t.cache["logits"], logits)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_embeddings_round_the_normalizer_to_their_dtype_as_gemma(dtype):
    ours = build_model(DecoderOnlyConfig(**{**LLAMA_LIKE, "d_model": 40, "heads": 4, "scale_embeddings": True}))
    ours = ours.to(dtype).eval()
    stack = ours.site_stacks()["decoder"][0]
    tokens = torch.randint(1, V, (2, 5))
    from attnlab.nn import trace

    with torch.no_grad(), trace(ours, cache="decoder.embed") as t:
        ours(tokens)
    expected = stack.embedding.token(tokens) * torch.tensor(40**0.5, dtype=dtype)  # Gemma's normalizer
    assert torch.equal(t.cache["decoder.embed"], expected)


VARIANTS = {
    "qwen2": {**LLAMA_LIKE, "qkv_bias": True},
    "neox": {**COMMON, "positional": "rope", "rotary_fraction": 0.5, "parallel_residual": True, "norm_first": True},
    "qwen3": {**LLAMA_LIKE, "qk_norm": "head"},
    "olmo2": {**LLAMA_LIKE, "qk_norm": "full", "norm_placement": "output"},
    "mistral": {**LLAMA_LIKE, "sliding_window": 3},
    "gemma2": {**GEMMA_LIKE, "sliding_layers": [0, 2], "attention_softcap": 1.0, "final_softcap": 5.0},
    "gemma3": {
        **GEMMA_LIKE,
        "qk_norm": "head",
        "local_rope_base": 10.0,
        "rope_scaling": {"type": "linear", "factor": 2},
    },
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_masking_a_head_equals_zeroing_its_columns_of_w_o_and_the_pattern_is_traced(name):
    from attnlab.nn import masking_heads, trace

    model = _perturbed(_ours(**VARIANTS[name]), 2)
    zeroed = _perturbed(_ours(**VARIANTS[name]), 2)
    layer, head, d = 1, 2, D // HEADS
    with torch.no_grad():
        zeroed.site_stacks()["decoder"][0].layers[layer].self_attn.out_proj.weight[:, head * d : (head + 1) * d] = 0
    xi = torch.ones(LAYERS, HEADS, dtype=torch.float64)
    xi[layer, head] = 0.0
    tokens = torch.randint(1, V, (2, 9))
    with torch.no_grad():
        with masking_heads(model, {"self": xi}), trace(model, ["*.attn.pattern", "*.attn.z"]) as traced:
            masked = model(tokens)
        torch.testing.assert_close(masked, zeroed(tokens), rtol=1e-12, atol=1e-12)
        assert not torch.allclose(masked, model(tokens))  # the head mattered
    pattern, z = traced.cache[f"decoder.{layer}.attn.pattern"], traced.cache[f"decoder.{layer}.attn.z"]
    assert torch.all(z[:, head] == 0)  # z of the masked head
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, HEADS, 9, dtype=torch.float64))
    assert torch.all(pattern.triu(1) == 0)  # causal
