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

from tests.unit.pretrained.tiny_hf import save_tokenizer, shift_vectors

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
    "n_group": 1,
    "topk_group": 1,
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
    "zaya": {"num_experts_per_tok": 1},
    "bamba": {"mamba_n_heads": 8, "mamba_d_head": 8, "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 8, "layer_types": ["mamba", "attention"]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "lfm2": {"layer_types": ["conv", "full_attention"]},
    "codegen": {"rotary_dim": 4},
}
"""Sizes a family spells its own way."""


def causal_types() -> list[str]:
    """Every ``model_type`` of transformers' causal-LM mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


_HEADS = [{}, {"num_key_value_heads": 4, "multi_query_group_num": 4}]  # a family whose heads all need keys (MLA)
_DEPTHS = [{}] + [{k: n for k in ("num_hidden_layers", "decoder_layers", "num_layers", "n_layer")} for n in (4, 8)]
VARIANTS: list[dict[str, Any]] = [{**depth, **heads} for depth in _DEPTHS for heads in _HEADS] + [
    {"embed_dim": ..., "num_heads": ..., "kv_channels": ...},  # aliases a config checks against its own sizes
]
"""What is tried in turn, on top of :data:`SMALL`, until the model runs and attends."""


def build_any(
    model_type: str, folder: Path, *, seed: int = 0, attending: bool = True, sizes: dict[str, Any] | None = None
) -> Any:
    """A random transformers causal LM of ``model_type`` with tiny sizes, saved into ``folder``
    (with tokenizer.json); returned in float64 with transformers' eager attention.

    The sizes are :data:`SMALL`, then each of :data:`VARIANTS` on top until transformers' model
    runs and returns at least one attention pattern (a hybrid's attention layers come every few
    layers); a composite config (text and vision) takes them as its ``text_config``. With
    ``attending`` False the first model that runs is taken (Mamba, to be refused); ``sizes`` go
    on top of all."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    save_tokenizer(folder)
    config_class = CONFIG_MAPPING[model_type]
    failure: Exception | None = None
    for variant in VARIANTS:
        chosen = {**SMALL, **variant, **OVERRIDES.get(model_type, {}), **(sizes or {})}
        chosen = {k: v for k, v in chosen.items() if v is not ...}
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            try:
                model = _model(config_class, chosen, seed)
                with torch.no_grad():
                    out = model(ids(1, 5), output_attentions=True, use_cache=False)
                if attending and not any(a is not None for a in (getattr(out, "attentions", None) or ())):
                    raise ValueError(
                        "transformers' model returns no attention pattern at any depth tried (no softmax attention)"
                    )
            except Exception as error:  # noqa: BLE001 - the next variant, or the first failure raised
                failure = failure or error
                continue
            model.save_pretrained(folder)
        return _reference(folder)
    raise failure  # type: ignore[misc]


def _reference(folder: Path, attention: str = "eager") -> Any:
    """transformers' model of ``folder`` in float64 with its ``attention`` implementation: the
    reference, read from the same files attnlab reads (buffers as transformers computes them on
    loading). Eager gives the patterns (its softmax runs in float32); SDPA, where the family has
    it, the logits in float64 throughout."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation=attention)
        except ValueError:  # no SDPA path in this family: its eager one
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
        with contextlib.suppress(Exception):
            model.set_experts_implementation("eager")
    return model.eval()


def _model(config_class: Any, sizes: dict[str, Any], seed: int) -> Any:
    from transformers import AutoModelForCausalLM

    if "text_config" in getattr(config_class, "sub_configs", {}):
        sizes = {**sizes, "text_config": dict(sizes)}
    config = _config(config_class, sizes)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        for key, value in sizes.items():
            if key != "text_config":
                with contextlib.suppress(Exception):
                    setattr(text, key, value)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with contextlib.suppress(Exception):  # grouped_mm, the experts' default, computes no float64
        model.set_experts_implementation("eager")
    shift_vectors(model)
    return model.eval()


def _config(config_class: Any, sizes: dict[str, Any]) -> Any:
    """``config_class(**sizes)``, leaving out the keys it refuses (a derived property, say), one by one."""
    sizes = dict(sizes)
    for _ in range(len(sizes)):
        try:
            return config_class(**sizes)
        except (AttributeError, TypeError, ValueError, NotImplementedError) as error:
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

    tokens = ids()
    exact = _reference(Path(reference.config._name_or_path), "sdpa")
    with torch.no_grad():
        expected = reference(tokens, output_attentions=True, use_cache=False)
        wanted_logits = exact(tokens, use_cache=False).logits
        sites = [s for s in lm.model.decoder.layers if s.self_attn is not None]
        with lm.trace("decoder.*.attn.pattern") as traced:
            logits = lm(tokens)
    scale = float(wanted_logits.abs().max())
    error = float((logits - wanted_logits).abs().max())
    assert error <= 1e-6 * scale, f"logits differ by {error:.2e} (largest logit {scale:.2e})"
    assert torch.equal(logits.argmax(-1), wanted_logits.argmax(-1)), "argmax differs"
    layers = lm.model.decoder.layers
    patterns = list(expected.attentions or ())
    if len(patterns) != len(layers):  # transformers returns patterns of the attention layers only
        patterns = [a for a in patterns if a is not None]
        layers = sites
    assert len(patterns) == len(layers), f"{len(patterns)} patterns from transformers, {len(layers)} layers"
    names = iter(n for n in traced.cache if n.endswith(".attn.pattern"))
    for layer, pattern in zip(layers, patterns):
        if layer.self_attn is None:
            continue  # a hybrid's layer without softmax attention
        name = next(names)
        mine = traced.cache[name]
        assert pattern is not None, f"{name}: transformers returns no pattern for this layer"
        assert mine.shape == pattern.shape, f"{name}: shape {tuple(mine.shape)}, transformers {tuple(pattern.shape)}"
        gap = float((mine - pattern).abs().max())
        assert gap <= 1e-5, f"{name} differs from transformers' eager attentions by {gap:.2e}"
    _check_head_mask(exact, lm, tokens)
    reference = exact
    prompt = tokens[:1, :5]
    with torch.no_grad():
        wanted = reference.generate(prompt, generation_config=_plain_greedy(reference))
    got = generate_continuations(
        lm.model, [prompt[0].tolist()], eos_id=-1, banned=(), options=DecodeOptions(max_length=6)
    )[0].tokens
    if got != wanted[0, 5:].tolist():  # where generate prepares other inputs than the forward pass takes
        stepped = prompt  # (RoBERTa's positions), transformers' own forward pass, step by step, decides
        with torch.no_grad():
            for _ in range(6):
                stepped = torch.cat([stepped, reference(stepped, use_cache=False).logits[:, -1:].argmax(-1)], dim=1)
        expected = stepped[0, 5:].tolist()
        assert got == expected, f"cached greedy generation {got} != transformers' {wanted[0, 5:].tolist()} / {expected}"


def _plain_greedy(reference: Any) -> Any:
    """Greedy search for 6 tokens and nothing else (no forced EOS, no repetition rules: BART's
    config.json forces EOS at the last step, and transformers fills unset options from it)."""
    from transformers import GenerationConfig

    for source in (reference.config, reference.generation_config):
        for key in ("forced_eos_token_id", "forced_bos_token_id", "no_repeat_ngram_size", "suppress_tokens"):
            if getattr(source, key, None) is not None:
                setattr(source, key, None)
    return GenerationConfig(
        max_new_tokens=6,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=2,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
        no_repeat_ngram_size=0,
        repetition_penalty=1.0,
        min_length=0,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )


def logits_with_pre_hook(reference: Any, module: Any, hook: Any, tokens: torch.Tensor) -> torch.Tensor:
    """transformers' logits for ``tokens`` with ``hook`` on the input of one of its modules."""
    handle = module.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return reference(tokens, use_cache=False).logits
    finally:
        handle.remove()


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

    expected = logits_with_pre_hook(reference, projection, zero_head, tokens)
    xi = lm.head_mask()
    xi["self"][index, head] = 0.0
    with torch.no_grad(), masking_heads(lm.model, xi):
        masked = lm(tokens)
    scale = float(expected.abs().max())
    error = float((masked - expected).abs().max())
    assert error <= 1e-6 * scale, f"masking head {index}:{head} differs by {error:.2e}"


# ---- encoder-decoders -------------------------------------------------------------------------------

SEQ2SEQ_SIZES: dict[str, Any] = {"d_kv": 8, "d_ff": 48, "decoder_start_token_id": 2, "is_decoder": False}
"""On top of :data:`SMALL` for an encoder-decoder: T5's own names, the decoder starting from the
padding id (as T5's does), no causal-LM flag."""

STUDIED_SEQ2SEQ = ("t5", "bart", "marian", "mbart", "pegasus")
"""The encoder-decoders issue 47 names: each must open and equal transformers."""


def seq2seq_types() -> list[str]:
    """Every ``model_type`` of transformers' seq2seq mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES)


def build_seq2seq(model_type: str, folder: Path, *, seed: int = 0) -> Any:
    """A random transformers encoder-decoder of ``model_type`` with tiny sizes (:data:`SMALL` and
    :data:`SEQ2SEQ_SIZES`), saved into ``folder`` with tokenizer.json; returned in float64, eager."""
    from transformers import AutoModelForSeq2SeqLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    save_tokenizer(folder)
    config = _config(CONFIG_MAPPING[model_type], {**SMALL, **SEQ2SEQ_SIZES})
    torch.manual_seed(seed)
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        model = AutoModelForSeq2SeqLM.from_config(config, attn_implementation="eager")
        shift_vectors(model)
        model.save_pretrained(folder)
        reference = AutoModelForSeq2SeqLM.from_pretrained(folder, dtype=torch.float64, attn_implementation="eager")
    return reference.eval()


SEQ2SEQ_PATTERNS = {"encoder_self": "encoder.{}.attn", "decoder_self": "decoder.{}.attn", "cross": "decoder.{}.cross"}
"""Each attention kind's site prefix, layer L in the braces."""


def check_bridged_seq2seq(reference: Any, lm: Any) -> None:
    """The bridged encoder-decoder ``lm`` (``attnlab.load`` of the folder, float64) against
    transformers' ``reference`` (eager, float64): logits, every layer's pattern of all three kinds,
    masking one head of each kind, KV-cached greedy decoding. An AssertionError names the first
    check that fails."""
    from attnlab.generate.search import DecodeOptions, decode
    from attnlab.nn import masking_heads

    src, tgt = ids(2, 7), ids(2, 5, seed=3)
    model = lm.model
    with torch.no_grad():
        expected = reference(input_ids=src, decoder_input_ids=tgt, output_attentions=True)
        with lm.trace(["*.attn.pattern", "*.cross.pattern"]) as traced:
            logits = model(src, tgt)
    scale = float(expected.logits.abs().max())
    error = float((logits - expected.logits).abs().max())
    assert error <= 1e-6 * scale, f"logits differ by {error:.2e} (largest logit {scale:.2e})"
    wanted = {
        "encoder_self": expected.encoder_attentions,
        "decoder_self": expected.decoder_attentions,
        "cross": expected.cross_attentions,
    }
    for kind, patterns in wanted.items():
        assert len(patterns) == lm.head_mask_shapes[kind][0], f"{kind}: {len(patterns)} layers in transformers"
        for layer, pattern in enumerate(patterns):
            name = SEQ2SEQ_PATTERNS[kind].format(layer) + ".pattern"
            gap = float((traced.cache[name] - pattern).abs().max())
            assert gap <= 1e-5, f"{name} differs from transformers' eager attentions by {gap:.2e}"
    names = {module: name for name, module in model.hf.named_modules()}
    modules = dict(reference.named_modules())
    for kind in wanted:
        layers = lm.head_mask_shapes[kind][0]
        stack = model.encoder if kind == "encoder_self" else model.decoder
        attention = getattr(stack.layers[layers - 1], "cross_attn" if kind == "cross" else "self_attn")
        head, width = attention.heads - 1, attention.d_v

        def zero_head(module: Any, args: tuple[Any, ...], head: int = head, width: int = width) -> tuple[Any, ...]:
            x = args[0].clone()
            x[..., head * width : (head + 1) * width] = 0
            return (x, *args[1:])

        handle = modules[names[attention.output]].register_forward_pre_hook(zero_head)
        try:
            with torch.no_grad():
                masked_reference = reference(input_ids=src, decoder_input_ids=tgt).logits
        finally:
            handle.remove()
        xi = lm.head_mask()
        xi[kind][layers - 1, head] = 0.0
        with torch.no_grad(), masking_heads(model, xi):
            masked = model(src, tgt)
        gap = float((masked - masked_reference).abs().max())
        assert gap <= 1e-6 * scale, f"masking {kind} head {layers - 1}:{head} differs by {gap:.2e}"
        assert gap < float((masked_reference - expected.logits).abs().max()), f"{kind}: the head changes nothing"
    start = reference.config.decoder_start_token_id
    with torch.no_grad():
        greedy = _plain_greedy(reference)
        greedy.decoder_start_token_id = start
        generated = reference.generate(src[:1], generation_config=greedy)
    options = DecodeOptions(max_length=6)
    got = decode(model, src[:1], bos_id=start, eos_id=-1, pad_id=lm.task.pad_id, options=options, banned=())
    assert got[0].tokens == generated[0, 1:].tolist(), f"cached greedy decoding {got[0].tokens} != {generated[0, 1:]}"
