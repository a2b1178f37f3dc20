"""A Llama-family decoder in attnlab equals Hugging Face's LlamaForCausalLM on the same weights:
rotary positions, grouped-query attention, RMSNorm, SwiGLU, no biases; left padding, KV cache and
the head mask xi_h on top. The model is built and filled by the ``llama`` family
(:data:`attnlab.pretrained.families.FAMILIES`) from tensors in memory, as a GGUF file's are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.errors import CheckpointError
from attnlab.nn import DecoderOnlyConfig, build_model, masking_heads
from attnlab.pretrained.families import FAMILIES
from attnlab.pretrained.layout import fill_state, held, layout_sources, take_weights

transformers = pytest.importorskip("transformers")

SHAPE = {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 48}
VOCAB = 61
# Hugging Face's LlamaRMSNorm normalises in float32 even for float64 inputs: the two models agree
# to float32 rounding (about 1e-7 here), where a wrong formula misses by 1e-2 or more.
ATOL = 1e-6


def _hf_config(kv_heads: int, tied: bool, rope_base: float) -> dict:
    """config.json of the Hugging Face Llama both models are built from."""
    return {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": SHAPE["d_model"],
        "intermediate_size": SHAPE["d_ff"],
        "num_hidden_layers": SHAPE["layers"],
        "num_attention_heads": SHAPE["heads"],
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope_base,
        "tie_word_embeddings": tied,
        "max_position_embeddings": 128,
        "pad_token_id": 0,
    }


def _fill(tensors: dict, expected: dict, hf: dict) -> dict:
    """attnlab's tensors from Hugging Face Llama tensors in memory, through the llama family's layout."""
    family, where = FAMILIES["llama"], Path("file.gguf")
    layout = family.layout(hf, hf["tie_word_embeddings"])
    sources = held(tensors.items(), where)
    ignored = family.ignored
    return fill_state(sources, expected, layout, hf, dtype=None, ignored=ignored, where=where, check_values=False)


def _pair(kv_heads: int, tied: bool, rope_base: float = 10000.0):
    """A random Hugging Face Llama and the attnlab model holding its weights, both float64."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(kv_heads + 10 * tied)
    hf = _hf_config(kv_heads, tied, rope_base)
    config = LlamaConfig(**{key: value for key, value in hf.items() if key not in ("model_type", "rope_theta")})
    config.rope_parameters = {"rope_type": "default", "rope_theta": rope_base}
    reference = LlamaForCausalLM(config).double().eval()
    with torch.no_grad():  # random norms gains, so that a wrong norm cannot pass
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    section = FAMILIES["llama"].model_section(hf, Path("config.json"))
    section.pop("kind")
    ours = build_model(DecoderOnlyConfig(vocab_size=VOCAB, pad_id=0, **section)).double().eval()
    tensors = {name: tensor.clone() for name, tensor in reference.state_dict().items()}
    if tied:
        tensors.pop("lm_head.weight")
    take_weights(ours, _fill(tensors, ours.state_dict(), hf))
    return reference, ours


def _left_padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    tokens = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    is_token = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return tokens, is_token


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("tied", [True, False])
def test_logits_equal_hugging_face_on_a_left_padded_batch(kv_heads: int, tied: bool) -> None:
    reference, ours = _pair(kv_heads, tied)
    # id 0 is also the padding id, and appears inside a row as a real token
    tokens, is_token = _left_padded([[5, 9, 0, 14, 3, 60, 7, 8], [11, 12], [1, 2, 3, 4, 5]])
    positions = (is_token.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = reference(input_ids=tokens, attention_mask=is_token.long(), position_ids=positions).logits
        got = ours(tokens, is_token=is_token)
    assert torch.allclose(got[is_token], expected[is_token], atol=ATOL, rtol=0)


def test_rope_base_reaches_the_attention() -> None:
    reference, ours = _pair(2, True, rope_base=500.0)
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    with torch.no_grad():
        assert torch.allclose(ours(tokens), reference(input_ids=tokens).logits, atol=ATOL, rtol=0)
    assert ours.decoder.layers[0].self_attn.rotary.base == 500.0


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_cached_decoding_equals_the_whole_sequence(kv_heads: int) -> None:
    """Step by step through the KV cache (which holds kv_heads heads), left padding included."""
    _, ours = _pair(kv_heads, True)
    tokens, is_token = _left_padded([[5, 9, 0, 14, 3, 60, 7, 8], [11, 12, 13]])
    with torch.no_grad():
        whole = ours(tokens, is_token=is_token)
        state = ours.new_state()
        prompt = ours(tokens[:, :4], is_token=is_token[:, :4], state=state)
        steps = [ours(tokens[:, t : t + 1], is_token=is_token[:, t : t + 1], state=state) for t in range(4, 8)]
    got = torch.cat([prompt, *steps], dim=1)
    assert torch.allclose(got[is_token], whole[is_token], atol=1e-10, rtol=0)
    assert state.layers[0].key.shape[1] == kv_heads


def test_head_mask_on_a_query_head_equals_zeroing_its_columns_of_w_o() -> None:
    """xi_h = 0 for query head h of a grouped layer removes exactly Att_h = head_h W_o^h."""
    _, ours = _pair(2, True)
    tokens = torch.tensor([[4, 8, 15, 16, 23, 42]])
    head_mask = torch.ones(SHAPE["layers"], SHAPE["heads"], dtype=torch.float64)
    head_mask[1, 3] = 0.0
    with torch.no_grad():
        with masking_heads(ours, {"self": head_mask}):
            masked = ours(tokens)
        d = SHAPE["d_model"] // SHAPE["heads"]
        ours.decoder.layers[1].self_attn.out_proj.weight[:, 3 * d : 4 * d] = 0.0
        zeroed = ours(tokens)
    assert torch.allclose(masked, zeroed, atol=1e-12, rtol=0)


def test_a_missing_or_extra_tensor_is_named() -> None:
    reference, ours = _pair(2, True)
    hf = _hf_config(2, True, 10000.0)
    tensors = dict(reference.state_dict())
    tensors.pop("lm_head.weight")
    broken = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(CheckpointError, match="file.gguf: tensor 'model.layers.1.mlp.up_proj.weight' is missing"):
        _fill(broken, ours.state_dict(), hf)
    with pytest.raises(CheckpointError, match="file.gguf: tensor 'model.layers.7.extra'"):
        _fill(tensors | {"model.layers.7.extra": torch.zeros(1)}, ours.state_dict(), hf)


def test_gguf_names_renamed_are_the_names_the_llama_family_takes() -> None:
    """GGUF's one table renames every tensor of a llama GGUF to a name the llama family's layout
    takes, and leaves none of the layout's untaken (layer 1 of 2, untied)."""
    pytest.importorskip("gguf")
    from attnlab.pretrained.gguf import HF_NAMES, hf_name

    taken = layout_sources(FAMILIES["llama"].layout(_hf_config(2, False, 10000.0), False))
    renamed = {hf_name(name.replace(".N.", ".1.")) for name in HF_NAMES}
    assert renamed == {name for name in taken if ".layers.0." not in name}
    assert hf_name("blk.1.attn_q.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.1.attn_q_norm.weight") == hf_name("rope_freqs.weight") == ""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("dtype", "relative"), [(torch.float32, 1e-5), (torch.bfloat16, 4e-2)])
def test_on_the_gpu_logits_cache_head_mask_and_greedy_tokens_match_float64(dtype, relative) -> None:
    """The same model on CUDA (PyTorch's GPU attention kernels, the KV cache on the GPU): logits of
    a left-padded batch, with and without a query head masked, within ``relative`` of the float64
    CPU logits' scale; cached decoding equal to the whole sequence there; greedy tokens equal."""
    import copy

    from attnlab.generate.search import DecodeOptions, generate_continuations

    _, ours = _pair(2, True)
    gpu = copy.deepcopy(ours).to("cuda", dtype)
    tokens, is_token = _left_padded([[5, 9, 0, 14, 3, 60, 7, 8], [11, 12], [1, 2, 3, 4, 5]])
    head_mask = torch.ones(SHAPE["layers"], SHAPE["heads"], dtype=torch.float64)
    head_mask[1, 3] = 0.0
    with torch.no_grad():
        for mask in (None, head_mask):
            with masking_heads(ours, None if mask is None else {"self": mask}):
                on_cpu = ours(tokens, is_token=is_token)
            with masking_heads(gpu, None if mask is None else {"self": mask.to("cuda", dtype)}):
                on_gpu = gpu(tokens.cuda(), is_token=is_token.cuda())
            assert on_gpu.dtype == dtype and on_gpu.device.type == "cuda"
            scale = on_cpu[is_token].abs().max()
            assert (on_gpu.double().cpu() - on_cpu)[is_token].abs().max() <= relative * scale
        state = gpu.new_state()
        prompt = gpu(tokens[:, :4].cuda(), is_token=is_token[:, :4].cuda(), state=state)
        steps = [
            gpu(tokens[:, t : t + 1].cuda(), is_token=is_token[:, t : t + 1].cuda(), state=state) for t in range(4, 8)
        ]
        whole = gpu(tokens.cuda(), is_token=is_token.cuda())
    cached = torch.cat([prompt, *steps], dim=1)
    assert (cached - whole)[is_token.cuda()].abs().max() <= relative * whole.abs().max()
    assert state.layers[0].key.shape[1] == 2 and state.layers[0].key.device.type == "cuda"
    if dtype == torch.float32:  # bfloat16 may flip a near tie
        prompts = [[5, 9, 14], [11, 12, 13, 3]]
        options = DecodeOptions(max_length=10)
        expected = generate_continuations(ours, prompts, eos_id=VOCAB, banned=(), options=options)
        got = generate_continuations(gpu, prompts, eos_id=VOCAB, banned=(), options=options)
        assert [h.tokens for h in got] == [h.tokens for h in expected]
