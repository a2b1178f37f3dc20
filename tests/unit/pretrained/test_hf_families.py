"""Every Hugging Face family attnlab opens equals transformers' own model on the same folder.

For each family a tiny model is built with transformers' own config class and random weights
(norms and biases moved away from their defaults, so a wrong norm or a dropped bias cannot pass),
saved with ``save_pretrained`` beside a small byte-level BPE tokenizer, opened with attnlab, and
compared in float64: logits of a left-padded batch, every layer's hidden state, the attention
weights, KV-cached decoding against the whole sequence, greedy generation token for token
against ``generate``, bf16 logits within bf16 rounding, and the tokenizer's ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.nn import trace
from attnlab.pretrained.checkpoint import find_checkpoint
from attnlab.pretrained.hf_model import open_checkpoint
from tests.unit.pretrained.tiny_hf import LAYERS, SIZES, TEXTS, VARIED, build

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=sorted(SIZES))
def family(request, tmp_path_factory) -> tuple[str, Path, Any, Any]:  # noqa: ANN001
    """(model_type, its folder, the transformers model and attnlab's, both float64)."""
    folder = tmp_path_factory.mktemp(request.param)
    reference = build(request.param, folder)
    ours = open_checkpoint(find_checkpoint(folder), dtype=torch.float64)
    return request.param, folder, reference, ours


def _left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    tokens = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    is_token = torch.tensor([[False] * (width - len(r)) + [True] * len(r) for r in rows])
    return tokens, is_token


def test_logits_of_a_left_padded_batch_equal_the_reference(family) -> None:  # noqa: ANN001
    """attnlab on the padded batch; transformers on each row alone (its float64 padded rows are NaN:
    its masked softmax fills with float32's minimum)."""
    _, _, reference, ours = family
    rows = [ours.task.encode(t) for t in TEXTS]
    tokens, is_token = _left_padded(rows, ours.task.pad)
    with torch.no_grad():
        got = ours.model(tokens, is_token=is_token)
        for index, row in enumerate(rows):
            expected = reference(torch.tensor([row])).logits[0]
            mine = got[index][is_token[index]]
            assert (mine - expected).abs().max() <= 1e-6 * expected.abs().max(), index
            assert torch.equal(mine.argmax(-1), expected.argmax(-1))


def test_every_layer_and_the_attention_weights_equal_the_reference(family) -> None:  # noqa: ANN001
    _, _, reference, ours = family
    tokens = torch.tensor([ours.task.encode(TEXTS[0])])
    with torch.no_grad():
        out = reference(tokens, output_hidden_states=True, output_attentions=True)
        with trace(ours.model, ["decoder.*.resid_post", "decoder.*.attn.pattern"]) as traced:
            ours.model(tokens)
    # Gemma's and OLMo's norms run in float32 in transformers, even on float64 inputs
    for layer in range(LAYERS - 1):  # the last hidden state of transformers is after the final norm
        expected = out.hidden_states[layer + 1]
        got = traced.cache[f"decoder.{layer}.resid_post"]
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max(), layer
    patterns = [traced.cache[f"decoder.{layer}.attn.pattern"] for layer in range(LAYERS)]
    for pattern, weights in zip(patterns, out.attentions, strict=True):
        torch.testing.assert_close(pattern, weights, atol=1e-6, rtol=1e-5)


def test_cached_decoding_equals_the_whole_sequence(family) -> None:  # noqa: ANN001
    _, _, _, ours = family
    tokens, is_token = _left_padded([ours.task.encode(t) for t in TEXTS[:2]], ours.task.pad)
    model = ours.model
    with torch.no_grad():
        whole = model(tokens, is_token=is_token)
        state = model.new_state()
        first = model(tokens[:, :5], is_token=is_token[:, :5], state=state)
        steps = [
            model(tokens[:, t : t + 1], is_token=is_token[:, t : t + 1], state=state) for t in range(5, tokens.shape[1])
        ]
    cached = torch.cat([first, *steps], dim=1)
    torch.testing.assert_close(cached[is_token], whole[is_token], atol=1e-10, rtol=1e-9)


def test_greedy_generation_equals_generate_token_for_token(family) -> None:  # noqa: ANN001
    from attnlab.generate.search import DecodeOptions, generate_continuations

    _, _, reference, ours = family
    prompts = [ours.task.encode(t) for t in TEXTS[:2]]
    hypotheses = generate_continuations(
        ours.model, prompts, eos_id=ours.task.eos, banned=(), options=DecodeOptions(max_length=8)
    )
    for prompt, hypothesis in zip(prompts, hypotheses, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=ours.task.eos, pad_token_id=2
            )[0, len(prompt) :].tolist()
        if ours.task.eos in expected:  # generate stops after the EOS it emits; attnlab leaves it out
            expected = expected[: expected.index(ours.task.eos)]
        assert hypothesis.tokens[: len(expected)] == expected


def test_bf16_weights_give_logits_within_bf16_rounding(family) -> None:  # noqa: ANN001
    _, folder, _, ours = family
    low = open_checkpoint(find_checkpoint(folder), dtype=torch.bfloat16)
    assert next(low.model.parameters()).dtype == torch.bfloat16
    tokens = torch.tensor([ours.task.encode(TEXTS[0])])
    with torch.no_grad():
        exact = ours.model(tokens)
        rounded = low.model(tokens).double()
    assert (rounded - exact).abs().max() <= 0.05 * exact.abs().max()


def test_token_ids_equal_autotokenizer(family) -> None:  # noqa: ANN001
    """transformers' fast tokenizer of the same files (the generic class: for a qwen2 folder
    AutoTokenizer would rebuild the pre-tokenizer from Qwen's own regex, which the real Qwen
    tokenizer.json holds and this test's small file does not)."""
    from transformers import PreTrainedTokenizerFast

    _, folder, _, ours = family
    reference = PreTrainedTokenizerFast.from_pretrained(folder)
    for text in VARIED + TEXTS:
        assert ours.task.encode(text) == reference(text).input_ids, text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(("dtype", "relative"), [(torch.float32, 1e-5), (torch.bfloat16, 5e-2), (torch.float16, 1e-2)])
def test_on_the_gpu_logits_and_a_masked_head_match_float64(family, dtype, relative) -> None:  # noqa: ANN001
    """The family on CUDA in fp32/bf16/fp16 (PyTorch's fused GPU attention, the head mask on the
    fused path): a left-padded batch's logits, with and without a head off, within ``relative``
    of the float64 CPU logits' scale; greedy tokens equal in fp32."""
    from attnlab.generate.search import DecodeOptions, generate_continuations
    from attnlab.head_ids import HeadId, mask_without
    from attnlab.nn import masking_heads
    from attnlab.pretrained.sources import open_model

    _, folder, _, ours = family
    gpu = open_model(folder, device="cuda", dtype=str(dtype).removeprefix("torch."))
    tokens, is_token = _left_padded([ours.task.encode(t) for t in TEXTS], ours.task.pad)
    for off in ([], [HeadId("self", LAYERS - 1, 1)]):
        with torch.no_grad():
            with masking_heads(ours.model, mask_without(ours.model, off) if off else None):
                expected = ours.model(tokens, is_token=is_token)
            mask = mask_without(gpu.model, off) if off else None
            with masking_heads(gpu.model, mask):
                got = gpu.model(tokens.cuda(), is_token=is_token.cuda())
        assert got.dtype == dtype and got.device.type == "cuda"
        assert (got.double().cpu() - expected)[is_token].abs().max() <= relative * expected[is_token].abs().max()
    if dtype == torch.float32:
        prompts = [ours.task.encode(t) for t in TEXTS[:2]]
        options = DecodeOptions(max_length=6)
        on_cpu = generate_continuations(ours.model, prompts, eos_id=ours.task.eos, banned=(), options=options)
        on_gpu = generate_continuations(gpu.model, prompts, eos_id=ours.task.eos, banned=(), options=options)
        assert [h.tokens for h in on_gpu] == [h.tokens for h in on_cpu]
