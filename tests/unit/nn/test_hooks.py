"""Named sites and hooks (attnlab.nn.hooks) on every model kind: reading changes nothing, cached
values equal what the model computes by other routes, zero ablation of a head's contribution is
xi_h = 0, patching restores, edits hit only their slice, hooks come off when a block ends."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.nn import (
    DecoderOnly,
    DecoderOnlyConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
    MultiHeadAttention,
    build_model,
    masking_heads,
    trace,
)
from attnlab.nn.hooks import model_sites, site_shapes
from attnlab.nn.model_configs import EncoderClassifierConfig, EncoderOnlyConfig

V = 23
SMALL = {"layers": 2, "d_model": 16, "heads": 4, "d_ff": 24, "dropout": 0.0}

MODELS = {
    "encoder_decoder": lambda: EncoderDecoderConfig(vocab_size=V, **SMALL),
    "classifier_hard": lambda: EncoderClassifierConfig(vocab_size=V, attention="hard", **SMALL),
    "llama_like": lambda: DecoderOnlyConfig(
        vocab_size=V,
        positional="rope",
        kv_heads=2,
        norm="rms",
        activation="swiglu",
        norm_first=True,
        bias=False,
        **SMALL,
    ),
    "encoder_relative": lambda: EncoderOnlyConfig(vocab_size=V, positional="relative", **SMALL),
    "decoder_alibi": lambda: DecoderOnlyConfig(vocab_size=V, positional="alibi", **SMALL),
    # the model-family variants (tests/unit/nn/test_variants.py): Gemma 2/3, GPT-NeoX, OLMo 2
    "gemma_like": lambda: DecoderOnlyConfig(
        vocab_size=V,
        positional="rope",
        kv_heads=2,
        norm="rms_one_plus",
        norm_placement="sandwich",
        activation="geglu",
        bias=False,
        qk_norm="head",
        sliding_window=3,
        sliding_layers=[0],
        local_rope_base=100.0,
        attention_softcap=1.0,
        final_softcap=5.0,
        query_scale=0.3,
        **SMALL,
    ),
    "neox_like": lambda: DecoderOnlyConfig(
        vocab_size=V, positional="rope", rotary_fraction=0.5, parallel_residual=True, norm_first=True, **SMALL
    ),
    "olmo_like": lambda: DecoderOnlyConfig(
        vocab_size=V,
        positional="rope",
        norm="rms",
        norm_placement="output",
        qk_norm="full",
        qkv_bias=True,
        bias=False,
        **SMALL,
    ),
}


def _model(name: str):
    torch.manual_seed(3)
    return build_model(MODELS[name]()).double().eval()


def _inputs(name: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, V, (3, 7), generator=generator)
    tokens[2, 5:] = 0  # padding in one row
    if name == "encoder_decoder":
        return tokens, torch.randint(1, V, (3, 5), generator=generator)
    return (tokens,)


def _stack(model) -> str:
    return next(iter(model.site_stacks()))


@pytest.mark.parametrize("name", list(MODELS))
def test_reading_every_site_leaves_the_output_as_it_was(name):
    model, inputs = _model(name), _inputs(name)
    with torch.no_grad():
        expected = model(*inputs)
        with trace(model, cache="*") as t:
            traced = model(*inputs)
    assert torch.allclose(traced, expected, atol=1e-12)
    assert list(t.cache) == list(t.sites)  # every site reached, in the documented order
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))  # nothing left installed


@pytest.mark.parametrize("name", list(MODELS))
def test_cached_sites_equal_what_the_model_computes_by_other_routes(name):
    model, inputs = _model(name), _inputs(name)
    with torch.no_grad(), trace(model, cache="*") as t:
        model(*inputs)
    cache, sites = t.cache, t.sites
    for site in (s for s in sites.values() if s.point == "pattern"):
        prefix = site.name.rsplit(".", 1)[0]
        attention = site.module
        if not hasattr(attention.position_bias, "value_table"):  # Shaw's relative positions add a value term
            # z_h = pattern_h v_h (a key/value head serves heads / kv_heads query heads)
            pattern, v = cache[f"{prefix}.pattern"], cache[f"{prefix}.v"]
            v = v.repeat_interleave(pattern.shape[1] // v.shape[1], dim=1)
            assert torch.allclose(cache[f"{prefix}.z"], pattern @ v, atol=1e-12)
        bias = 0 if attention.out_proj.bias is None else attention.out_proj.bias
        # out = sum_h result_h + b^O  and  result_h = z_h W_o^h
        assert torch.allclose(cache[f"{prefix}.result"].sum(1) + bias, cache[f"{prefix}.out"], atol=1e-12)
        w_o = attention.out_proj.weight.view(attention.d_model, attention.heads, attention.d_v)
        for h in range(attention.heads):
            assert torch.allclose(cache[f"{prefix}.result"][:, h], cache[f"{prefix}.z"][:, h] @ w_o[:, h].T)
        if attention.normalizer == "softmax":  # pattern = softmax(scores) over the keys a query may see
            scores, pattern = cache[f"{prefix}.scores"], cache[f"{prefix}.pattern"]
            allowed = pattern > 0
            expected = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
            assert torch.allclose(pattern, expected, atol=1e-12)
        else:  # hard attention: one-hot on the first best allowed score
            pattern = cache[f"{prefix}.pattern"]
            assert torch.equal(pattern.max(-1).values, pattern.sum(-1)) and set(pattern.unique().tolist()) <= {0.0, 1.0}
    for stack, (body, _) in model.site_stacks().items():
        for index in range(len(body.layers) - 1):  # one layer's output is the next one's input
            assert torch.equal(cache[f"{stack}.{index}.resid_post"], cache[f"{stack}.{index + 1}.resid_pre"])
        if model.config.placement == "post":
            last = len(body.layers) - 1
            assert torch.equal(cache[f"{stack}.final_norm"], cache[f"{stack}.{last}.resid_post"])  # post-LN
        if f"{stack}.pos_embed" in cache:  # the first residual is token + position embeddings
            summed = cache[f"{stack}.embed"] + cache[f"{stack}.pos_embed"]
            assert torch.allclose(body.embedding.norm(summed), cache[f"{stack}.0.resid_pre"], atol=1e-12)


@pytest.mark.parametrize("name", list(MODELS))
def test_zero_ablating_a_heads_contribution_equals_masking_it_with_xi(name):
    model, inputs = _model(name), _inputs(name)
    kind, heads = next(iter(model.head_mask_shapes().items()))[0], model.head_mask_shapes()
    layers, width = heads[kind]
    xi = {k: torch.ones(shape, dtype=torch.float64) for k, shape in heads.items()}
    xi[kind][1, 2] = 0.0
    with torch.no_grad():
        with masking_heads(model, xi):
            masked = model(*inputs)
        site = next(s for s in model_sites(model).values() if s.kind == kind and s.layer == 1 and s.point == "result")
        with trace(model) as t:
            t.scale(site.name, 0.0, heads=[2])
            ablated = model(*inputs)
        with trace(model) as t:  # the same through z, before W^O
            t.replace(site.name.replace("result", "z"), 0.0, heads=2)
            through_z = model(*inputs)
    assert torch.allclose(ablated, masked, atol=1e-12) and torch.allclose(through_z, masked, atol=1e-12)
    assert not torch.allclose(masked, model(*inputs), atol=1e-6)  # the head mattered


@pytest.mark.parametrize("name", ["classifier_hard", "llama_like", "encoder_relative", "decoder_alibi"])
def test_patching_clean_into_clean_changes_nothing_and_a_whole_residual_restores_the_clean_output(name):
    model = _model(name)
    clean, corrupt = _inputs(name, seed=1), _inputs(name, seed=2)
    stack = _stack(model)
    with torch.no_grad():
        with trace(model, cache="*") as clean_trace:
            clean_out = model(*clean)
        corrupt_out = model(*corrupt)
        every = [n for n in clean_trace.sites if n not in ("logits",) and not n.endswith((".k", ".v"))]
        with trace(model) as t:
            for site in every:
                t.replace(site, clean_trace.cache[site])
            same = model(*clean)
        # Equal up to the order of a sum: reading `result` sums the heads' terms one by one.
        assert torch.allclose(same, clean_out, rtol=0, atol=1e-12)
        with trace(model, cache="*.resid_pre") as residuals:  # the fused path, as the patched runs take
            plain_out = model(*clean)
        for layer in range(2):
            with trace(model) as t:
                t.replace(f"{stack}.{layer}.resid_pre", residuals.cache[f"{stack}.{layer}.resid_pre"])
                restored = model(*corrupt)
            assert torch.equal(restored, plain_out)
    assert not torch.allclose(corrupt_out, clean_out)


def test_an_edit_changes_only_its_slice():
    model, (tokens,) = _model("llama_like"), _inputs("llama_like")
    site = "decoder.0.attn.z"
    with torch.no_grad(), trace(model, cache=site) as t:
        model(tokens)
        before = t.cache[site]
        t.add(site, 1.0, examples=[0, 2], heads=[1, 3], positions=slice_positions(4))
        model(tokens)
        after = t.cache[site]
    changed = (after - before).ne(0)
    expected = torch.zeros_like(changed)
    for b in (0, 2):
        for h in (1, 3):
            expected[b, h, 4:] = True
    assert torch.equal(changed, expected)


def slice_positions(start: int) -> list[int]:
    return list(range(start, 7))


def test_an_edited_pattern_is_what_multiplies_the_values():
    model, (tokens,) = _model("decoder_alibi"), _inputs("decoder_alibi")
    causal = torch.tril(torch.ones(7, 7, dtype=torch.float64))
    uniform = causal / causal.sum(-1, keepdim=True)  # each query spreads evenly over its prefix
    with torch.no_grad(), trace(model, cache=["decoder.1.attn.v", "decoder.1.attn.z"]) as t:
        t.replace("decoder.1.attn.pattern", uniform, heads=[0])
        model(tokens[:2])  # rows without padding
    z, v = t.cache["decoder.1.attn.z"], t.cache["decoder.1.attn.v"]
    assert torch.allclose(z[:, 0], uniform @ v[:, 0], atol=1e-12)


def test_nested_traces_compose_and_leave_the_model_untouched():
    model, (tokens,) = _model("classifier_hard"), _inputs("classifier_hard")
    with torch.no_grad():
        plain = model(tokens)
        with trace(model) as outer:
            outer.scale("encoder.0.ffn.out", 0.0)
            outer_only = model(tokens)
            with trace(model, cache="encoder.0.ffn.out") as inner:
                inner.add("encoder.0.resid_pre", 0.5)
                both = model(tokens)
            assert torch.equal(inner.cache["encoder.0.ffn.out"], torch.zeros_like(inner.cache["encoder.0.ffn.out"]))
            assert torch.equal(model(tokens), outer_only)
        assert torch.equal(model(tokens), plain)
    assert not torch.equal(both, outer_only)


def test_gradients_flow_through_an_added_vector():
    model, (tokens,) = _model("llama_like"), _inputs("llama_like")
    steer = torch.zeros(16, dtype=torch.float64, requires_grad=True)
    with trace(model) as t:
        t.add("decoder.1.resid_pre", steer, positions=[3])
        model(tokens)[:, -1].sum().backward()
    assert steer.grad is not None and steer.grad.abs().sum() > 0


def test_bad_site_requests_are_clear_errors():
    model = _model("encoder_decoder")
    with pytest.raises(ValueError, match=r"site 'encoder\.0\.atn\.z': no such site in this model; did you mean"):
        with trace(model, cache="encoder.0.atn.z"):
            pass
    with trace(model) as t:
        with pytest.raises(ValueError, match=r"heads= needs a site with a head axis"):
            t.scale("encoder.0.resid_pre", 0.0, heads=[1])
        with pytest.raises(ValueError, match=r"no such site"):
            t.scale("decoder.9.cross.z", 0.0)
        t.replace("decoder.0.cross.z", torch.zeros(2, 2))
        with pytest.raises(ValueError, match=r"shape \(2, 2\) does not broadcast to the site's \(3, 4, 5, 4\)"):
            model(*_inputs("encoder_decoder"))
    with pytest.raises(TypeError, match="no named sites"):
        model_sites(torch.nn.Linear(2, 2))
    assert "encoder.pos_embed" not in model_sites(_model("encoder_relative"))  # relative: nothing added
    assert "logits" not in model_sites(_model("encoder_relative"))  # an encoder-only model's output is final_norm


def test_the_top_level_names_are_the_modules_functions():
    assert attnlab.trace is trace and attnlab.model_sites is model_sites


@pytest.mark.parametrize("name", list(MODELS))
def test_site_shapes_name_every_site_with_the_models_sizes(name):
    model = _model(name)
    shapes = site_shapes(model)
    assert list(shapes) == list(model_sites(model))
    stack = _stack(model)
    assert shapes[f"{stack}.0.resid_pre"][1] == "(B, T, 16)"
    assert shapes[f"{stack}.0.attn.z"][1] == "(B, 4, T, 4)"
    assert shapes[f"{stack}.0.attn.pattern"][1] == "(B, 4, T, T_k)"
    kv = MODELS[name]().key_value_heads
    assert shapes[f"{stack}.1.attn.k"][1] == f"(B, {kv}, T_k, 4)"  # grouped-query: the key/value heads
    assert shapes[f"{stack}.0.ffn.hidden"][1] == "(B, T, 24)"
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))  # nothing left installed


def test_site_shapes_inside_a_trace_leave_the_traces_edits_in_place():
    model, (tokens,) = _model("classifier_hard"), _inputs("classifier_hard")
    with torch.no_grad(), trace(model) as t:
        t.scale("encoder.0.ffn.out", 0.0)
        edited = model(tokens)
        site_shapes(model)
        assert torch.equal(model(tokens), edited)


def test_the_head_mask_scales_z_before_any_other_hook_and_comes_off():
    model, (tokens,) = _model("llama_like"), _inputs("llama_like")
    xi = {"self": torch.ones(2, 4, dtype=torch.float64)}
    xi["self"][0, 1] = 0.0
    with torch.no_grad(), trace(model, cache="decoder.0.attn.z") as t, masking_heads(model, xi):
        model(tokens)  # the mask installed after the trace still scales z before the trace reads it
    assert torch.equal(t.cache["decoder.0.attn.z"][:, 1], torch.zeros_like(t.cache["decoder.0.attn.z"][:, 1]))
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))


def test_a_per_example_head_mask_is_differentiable_per_example():
    model, inputs = _model("encoder_decoder"), _inputs("encoder_decoder")
    shapes = model.head_mask_shapes()
    xi = {kind: torch.ones(3, *shape, dtype=torch.float64, requires_grad=True) for kind, shape in shapes.items()}
    with masking_heads(model, xi):
        logits = model(*inputs)
    logits[0].sum().backward()  # example 0 only
    for kind in shapes:
        grad = xi[kind].grad
        assert grad[0].abs().sum() > 0 and torch.equal(grad[1:], torch.zeros_like(grad[1:]))
    with pytest.raises(ValueError, match="head_mask batch size 2 does not match the input's 3"):
        with masking_heads(model, {k: torch.ones(2, *s, dtype=torch.float64) for k, s in shapes.items()}):
            model(*inputs)


# ---- every attention call's pattern and z, traced ----

SMALLER = {"vocab_size": 11, "layers": 2, "d_model": 16, "heads": 4, "d_ff": 32, "dropout": 0.0}


def test_tracing_pattern_and_z_reaches_every_call_of_an_encoder_decoder():
    model = EncoderDecoder(EncoderDecoderConfig(**SMALLER)).eval()
    src, tgt = torch.randint(1, 11, (3, 7)), torch.randint(1, 11, (3, 5))
    plain = model(src, tgt)
    with trace(model, ["*.attn.pattern", "*.attn.z", "*.cross.pattern", "*.cross.z"]) as traced:
        output = model(src, tgt)
    torch.testing.assert_close(output, plain, atol=1e-6, rtol=0)
    called = [(traced.sites[name].kind, traced.sites[name].layer) for name in traced.cache if name.endswith(".z")]
    assert called == [
        ("encoder_self", 0),
        ("encoder_self", 1),
        ("decoder_self", 0),
        ("cross", 0),
        ("decoder_self", 1),
        ("cross", 1),
    ]  # the cache is in call order
    shapes = {
        traced.sites[name].kind: (
            tuple(traced.cache[name].shape),
            tuple(traced.cache[name[: -len("z")] + "pattern"].shape),
        )
        for name in traced.cache
        if name.endswith(".z")
    }
    assert shapes == {
        "encoder_self": ((3, 4, 7, 4), (3, 4, 7, 7)),
        "decoder_self": ((3, 4, 5, 4), (3, 4, 5, 5)),
        "cross": ((3, 4, 5, 4), (3, 4, 5, 7)),
    }
    for name in (name for name in traced.cache if name.endswith(".pattern")):
        weights = traced.cache[name]
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]))
    decoder_self = traced.cache["decoder.0.attn.pattern"]
    assert (decoder_self.triu(1) == 0).all()  # masked self-attention never looks ahead


def test_tracing_stops_after_the_block():
    model = DecoderOnly(DecoderOnlyConfig(**SMALLER))
    x = torch.randint(1, 11, (2, 4))
    with trace(model, ["*.attn.pattern", "*.attn.z"]) as traced:
        model(x)
    kept = dict(traced.cache)
    model(x)
    assert len(kept) == 4 and all(traced.cache[name] is tensor for name, tensor in kept.items())
    assert all(not m.hooks for m in model.modules() if hasattr(m, "hooks"))


def test_traced_head_outputs_reflect_the_head_mask():
    model = DecoderOnly(DecoderOnlyConfig(**SMALLER)).eval()
    mask = {"self": torch.tensor([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])}
    with trace(model, "*.attn.z") as traced, masking_heads(model, mask):
        model(torch.randint(1, 11, (2, 4)))
    assert (traced.cache["decoder.0.attn.z"][:, 1] == 0).all()
    assert (traced.cache["decoder.1.attn.z"].abs().sum((0, 2, 3)) > 0).all()


def test_the_pattern_of_hard_attention_has_one_hot_rows():
    model = DecoderOnly(DecoderOnlyConfig(**SMALLER, attention="hard"))
    with trace(model, "*.attn.pattern") as traced:
        model(torch.randint(1, 11, (2, 6)))
    assert len(traced.cache) == 2
    for weights in traced.cache.values():
        assert set(weights.unique().tolist()) <= {0.0, 1.0}
        assert (weights.sum(-1) == 1).all()


def test_tracing_a_single_module_and_keeping_the_graph():
    mha = MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16, requires_grad=True)
    with trace(mha, ["attn.pattern", "attn.z"], detach=False) as traced:
        mha(x)
    assert list(traced.cache) == ["attn.pattern", "attn.z"]
    traced.cache["attn.pattern"].sum().backward()
    assert x.grad is not None
    with pytest.raises(TypeError, match="no named sites"):
        with trace(torch.nn.Linear(2, 2)):
            pass


# ---- the sites inside norms, before rotary positions and inside the FFN -------------------------


def _norm_output(add_norm, name: str, cache: dict, post: bool = False) -> torch.Tensor:
    """gain(normalized) of an Add & Norm's (post) norm, from the cached ``normalized`` site."""
    module, point = (add_norm.post_norm, "post_normalized") if post else (add_norm.norm, "normalized")
    return add_norm.norm_kind.gain(module, cache[f"{name}.{point}"], torch.float64)


def _centred(x: torch.Tensor, layer_norm: bool) -> torch.Tensor:
    return x - x.mean(-1, keepdim=True) if layer_norm else x


@pytest.mark.parametrize("name", ["llama_like", "gemma_like", "encoder_decoder", "olmo_like", "neox_like"])
def test_norm_sites_are_the_scale_and_the_normalised_input_and_give_the_norms_output(name):
    model, inputs = _model(name), _inputs(name)
    with torch.no_grad(), trace(model, cache="*") as t:
        model(*inputs)
    cache, stack = t.cache, _stack(model)
    config = model.config
    for index, layer in enumerate(model.site_stacks()[stack][0].layers):
        prefix = f"{stack}.{index}"
        attn_norm = layer.site_norms[0]
        layer_norm = attn_norm.norm_kind.centred
        if config.placement == "post":  # Norm(x + Attn(x)): its input is the sum, its output resid_mid
            norm_input, norm_output = (
                cache[f"{prefix}.resid_pre"] + cache[f"{prefix}.attn.out"],
                cache[f"{prefix}.resid_mid"],
            )
        elif config.placement == "output":  # x + Norm(Attn(x))
            norm_input = cache[f"{prefix}.attn.out"]
            norm_output = cache[f"{prefix}.resid_mid"] - cache[f"{prefix}.resid_pre"]
        else:  # Norm(x) then attention
            norm_input, norm_output = (
                cache[f"{prefix}.resid_pre"],
                attn_norm.norm_kind.apply(attn_norm.norm, cache[f"{prefix}.resid_pre"]),
            )
        scale, normalized = cache[f"{prefix}.attn_norm.scale"], cache[f"{prefix}.attn_norm.normalized"]
        centred = _centred(norm_input, layer_norm)
        assert scale.shape == (*norm_input.shape[:-1], 1)
        expected_scale = torch.sqrt(centred.pow(2).mean(-1, keepdim=True) + attn_norm.norm.eps)
        assert torch.allclose(scale, expected_scale, atol=1e-12)
        assert torch.allclose(normalized * scale, centred, atol=1e-12)
        assert torch.allclose(_norm_output(attn_norm, f"{prefix}.attn_norm", cache), norm_output, atol=1e-12)
        if config.placement == "sandwich":  # x + Norm_post(Attn(Norm(x)))
            post = _norm_output(attn_norm, f"{prefix}.attn_norm", cache, post=True)
            assert torch.allclose(post, cache[f"{prefix}.resid_mid"] - cache[f"{prefix}.resid_pre"], atol=1e-12)
    final = model.site_stacks()[stack][0]
    if final.final_norm_kind is not None:  # the final norm: gain(normalized) is the stack's output
        out = final.final_norm_kind.gain(final.final_norm, cache[f"{stack}.final_norm.normalized"], torch.float64)
        assert torch.allclose(out, cache[f"{stack}.final_norm"], atol=1e-12)


@pytest.mark.parametrize("name", ["llama_like", "gemma_like", "neox_like", "olmo_like", "encoder_decoder"])
def test_queries_and_keys_before_rotary_positions_rotate_into_q_and_k(name):
    model, inputs = _model(name), tuple(x[:2] for x in _inputs(name))  # rows without padding
    with torch.no_grad(), trace(model, cache="*") as t:
        model(*inputs)
    stack = _stack(model)
    attention = model.site_stacks()[stack][0].layers[1].self_attn
    q_pre, k_pre = t.cache[f"{stack}.1.attn.q_pre"], t.cache[f"{stack}.1.attn.k_pre"]
    assert q_pre.shape[1] == attention.heads and k_pre.shape[1] == attention.kv_heads
    if attention.rotary is None:
        expected = (q_pre, k_pre)
    else:
        expected = attention.rotary(q_pre, k_pre, torch.arange(q_pre.shape[2]))
    assert torch.allclose(expected[0], t.cache[f"{stack}.1.attn.q"], atol=1e-12)
    assert torch.allclose(expected[1], t.cache[f"{stack}.1.attn.k"], atol=1e-12)
    if name == "llama_like":  # no q/k norm, no bias: q_pre is the norm's output times W^Q, head by head
        normed = _norm_output(attention_norm := model.decoder.layers[1].attn_norm, "decoder.1.attn_norm", t.cache)
        assert attention_norm.placement == "pre"
        w_q = attention.in_proj_weight[: attention.heads * attention.d_k]
        by_hand = (normed @ w_q.T).unflatten(-1, (attention.heads, attention.d_k)).transpose(1, 2)
        assert torch.allclose(by_hand, q_pre, atol=1e-12)
    with torch.no_grad(), trace(model, cache=f"{stack}.1.attn.pattern") as edited:  # zero queries: even weights
        edited.scale(f"{stack}.1.attn.q_pre", 0.0)
        model(*inputs)
    pattern = edited.cache[f"{stack}.1.attn.pattern"]
    allowed = (pattern > 0).double()
    assert torch.allclose(pattern, allowed / allowed.sum(-1, keepdim=True), atol=1e-12)


@pytest.mark.parametrize("name", ["llama_like", "gemma_like", "encoder_decoder"])
def test_ffn_sites_before_the_activation_give_the_hidden_layer_and_edits_reach_the_output(name):
    model, inputs = _model(name), _inputs(name)
    stack = _stack(model)
    ffn = model.site_stacks()[stack][0].layers[0].feed_forward
    prefix = f"{stack}.0.ffn"
    with torch.no_grad(), trace(model, cache="*") as t:
        plain = model(*inputs)
    cache = t.cache
    if ffn.activation_name in ("swiglu", "geglu"):
        assert f"{prefix}.pre" not in cache
        gate_fn = (
            torch.nn.functional.silu
            if ffn.activation_name == "swiglu"
            else (lambda g: torch.nn.functional.gelu(g, approximate="tanh"))
        )
        w_gate, w_up = ffn.linear1.weight.chunk(2, dim=0)
        normed = _norm_output(model.site_stacks()[stack][0].layers[0].ffn_norm, f"{stack}.0.ffn_norm", cache)
        assert torch.allclose(cache[f"{prefix}.gate"], normed @ w_gate.T, atol=1e-12)
        assert torch.allclose(cache[f"{prefix}.up"], normed @ w_up.T, atol=1e-12)
        assert torch.allclose(
            gate_fn(cache[f"{prefix}.gate"]) * cache[f"{prefix}.up"], cache[f"{prefix}.hidden"], atol=1e-12
        )
        zeroed = f"{prefix}.up"  # act(gate) * 0: the FFN adds nothing (no biases)
    else:
        assert f"{prefix}.gate" not in cache
        assert torch.allclose(torch.relu(cache[f"{prefix}.pre"]), cache[f"{prefix}.hidden"], atol=1e-12)
        zeroed = f"{prefix}.pre"  # relu(0) = 0: the FFN's output is b_2
    with torch.no_grad(), trace(model, cache=[f"{prefix}.out"]) as edited:
        edited.scale(zeroed, 0.0)
        changed = model(*inputs)
    bias = ffn.linear2.bias if ffn.linear2.bias is not None else torch.zeros((), dtype=torch.float64)
    assert torch.allclose(edited.cache[f"{prefix}.out"], bias.expand_as(edited.cache[f"{prefix}.out"]), atol=1e-12)
    assert not torch.allclose(changed, plain, atol=1e-6)


def test_doubling_the_final_norms_scale_halves_the_logits_of_an_rms_norm_model_without_biases():
    model, (tokens,) = _model("llama_like"), _inputs("llama_like")
    with torch.no_grad():
        plain = model(tokens)
        with trace(model) as t:
            t.scale("decoder.final_norm.scale", 2.0)
            halved = model(tokens)
        with trace(model) as t:  # the same through the normalised input
            t.scale("decoder.final_norm.normalized", 0.5)
            also = model(tokens)
    assert torch.allclose(halved, plain / 2, atol=1e-12) and torch.allclose(also, plain / 2, atol=1e-12)


def test_the_classifiers_pooled_input_times_its_weights_is_its_logits():
    model, (tokens,) = _model("classifier_hard"), _inputs("classifier_hard")
    with torch.no_grad(), trace(model, cache=["pooled", "logits"]) as t:
        model(tokens)
    assert t.sites["pooled"].position_axis is None and t.cache["pooled"].shape == (3, 16)
    expected = t.cache["pooled"] @ model.classifier.weight.T + model.classifier.bias
    assert torch.allclose(expected, t.cache["logits"], atol=1e-12)


def test_the_embeddings_norm_sites_give_the_first_residual():
    torch.manual_seed(3)
    config = EncoderOnlyConfig(vocab_size=V, embedding_norm=True, type_vocab_size=2, **SMALL)
    model, (tokens,) = build_model(config).double().eval(), _inputs("encoder_relative")
    with torch.no_grad(), trace(model, cache="*") as t:
        plain = model(tokens)
    cache, embedding = t.cache, model.encoder.embedding
    summed = cache["encoder.embed"] + cache["encoder.pos_embed"] + embedding.token_type.weight[0]
    centred = summed - summed.mean(-1, keepdim=True)
    assert torch.allclose(cache["encoder.embed_norm.normalized"] * cache["encoder.embed_norm.scale"], centred)
    gained = cache["encoder.embed_norm.normalized"] * embedding.norm.weight + embedding.norm.bias
    assert torch.allclose(gained, cache["encoder.0.resid_pre"], atol=1e-12)
    with torch.no_grad(), trace(model, cache="encoder.0.resid_pre") as edited:  # LayerNorm's output: its bias
        edited.scale("encoder.embed_norm.normalized", 0.0)
        assert not torch.allclose(model(tokens), plain)
    first = edited.cache["encoder.0.resid_pre"]
    assert torch.equal(first, embedding.norm.bias.expand_as(first))
    assert "encoder.embed_norm.scale" not in model_sites(_model("encoder_relative"))  # no norm, no site
