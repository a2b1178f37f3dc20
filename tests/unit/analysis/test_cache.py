"""The activation cache's helpers (attnlab.analysis.cache) and test_prompt (attnlab.analysis.prompt_test)
on float64 models: attnlab's own with LayerNorm (learned positions, biases) and with RMSNorm (sandwich
branch norms, a soft cap), and a bridged GPT-2 (transformers' modules, sites only). The residual
stream's decompositions sum to it, head results and biases to the attention output, and the parts'
logit attributions with the offsets to the logits, exactly; bad input is one UsageError naming it."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.analysis.cache import ActivationCache, run_with_cache
from attnlab.analysis.logit_attribution import direct_logit_attribution
from attnlab.analysis.maps import continuation_ids
from attnlab.analysis.prompt_test import test_prompt as check_prompt
from attnlab.errors import UsageError
from attnlab.nn import trace
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run

MODELS = {
    "layer-learned-bias": {"norm": "layer", "positional": "learned", "bias": True, "activation": "gelu"},
    "rms-sandwich-capped": {"norm": "rms", "norm_placement": "sandwich", "final_softcap": 2.0},
    "bridged-gpt2": None,
}
TEXTS = ["the cat sat on", "hello world"]
EXACT = {"atol": 1e-9, "rtol": 0.0}


@pytest.fixture(scope="module", params=sorted(MODELS))
def run(request, tmp_path_factory):  # noqa: ANN001
    """(loaded, logits, cache) of the model on TEXTS, a left-padded batch of two."""
    folder = tmp_path_factory.mktemp(request.param)
    if MODELS[request.param] is None:
        pytest.importorskip("transformers")
        from tests.unit.pretrained.tiny_hf import build

        build("gpt2", folder)
        loaded = attnlab.load(folder, dtype="float64", bridge=True).loaded
        assert loaded.model.bridged
    else:
        path, _ = tiny_lm_run(folder, model=MODELS[request.param])
        loaded = open_run(path)
        loaded.model.double()
    logits, cache = run_with_cache(loaded, TEXTS)
    return loaded, logits, cache


def _before_cap(loaded, value: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
    """What the model's logits are given the sum z: cap tanh(z / cap) with a soft cap, z without."""
    cap = loaded.model.config.final_softcap
    return value if cap is None else cap * torch.tanh(value / cap)


def _last(cache: ActivationCache, point: str) -> torch.Tensor:
    return cache[f"decoder.{cache.layers - 1}.{point}"]


def test_the_cache_holds_every_site_and_the_batch(run) -> None:  # noqa: ANN001
    loaded, logits, cache = run
    with trace(loaded.model) as t:
        assert set(cache) == set(t.sites)
    assert cache.tokens.shape == cache.is_token.shape == logits.shape[:2] and not bool(cache.is_token[1, 0])
    torch.testing.assert_close(cache["logits"], logits, **EXACT)
    assert "decoder.0.resid_pre" in cache and "nowhere" not in cache and cache.get("nowhere") is None


def test_decompose_resid_sums_to_the_stream(run) -> None:  # noqa: ANN001
    _, _, cache = run
    stack, labels = cache.decompose_resid(return_labels=True)
    assert stack.shape == (len(labels), *_last(cache, "resid_post").shape)
    assert labels[0] == "embed" and labels[-2:] == [f"{cache.layers - 1}.attn", f"{cache.layers - 1}.ffn"]
    torch.testing.assert_close(stack.sum(0), _last(cache, "resid_post"), **EXACT)
    torch.testing.assert_close(cache.decompose_resid(layer=1).sum(0), cache["decoder.1.resid_pre"], **EXACT)
    parts = cache.decompose_resid(mode="attn", incl_embeds=False).sum(0) + cache.decompose_resid(mode="mlp").sum(0)
    torch.testing.assert_close(parts, _last(cache, "resid_post"), **EXACT)
    assert cache.decompose_resid(pos_slice=-1).shape == (len(labels), 2, _last(cache, "resid_post").shape[-1])


def test_accumulated_resid_ends_with_the_last_stream(run) -> None:  # noqa: ANN001
    _, _, cache = run
    stack, labels = cache.accumulated_resid(return_labels=True)
    assert labels == [f"decoder.{layer}.resid_pre" for layer in range(cache.layers)] + ["decoder.1.resid_post"]
    torch.testing.assert_close(stack[-1], _last(cache, "resid_post"), **EXACT)
    torch.testing.assert_close(cache.accumulated_resid(apply_final_norm=True)[-1], cache["decoder.final_norm"], **EXACT)
    if "decoder.0.resid_mid" in cache:
        _, labels = cache.accumulated_resid(layer=1, incl_mid=True, return_labels=True)
        assert labels == ["decoder.0.resid_pre", "decoder.0.resid_mid", "decoder.1.resid_pre"]


def test_head_results_and_biases_sum_to_each_attention_branch(run) -> None:  # noqa: ANN001
    loaded, _, cache = run
    layers, heads = loaded.model.head_mask_shapes()["self"]
    stack, labels = cache.stack_head_results(incl_bias=True, return_labels=True)
    assert stack.shape[0] == layers * heads + layers and labels[heads + 1] == "1.attn.head.1"
    branches = dict(zip(*reversed(cache.decompose_resid(return_labels=True)), strict=True))
    for layer in range(layers):
        summed = stack[layer * heads : (layer + 1) * heads].sum(0) + stack[layers * heads + layer]
        torch.testing.assert_close(summed, branches[f"{layer}.attn"], **EXACT)
        if loaded.model.config.placement == "pre":  # the branch is the attention's output itself
            torch.testing.assert_close(summed, cache[f"decoder.{layer}.attn.out"], **EXACT)
            torch.testing.assert_close(stack[layer * heads + 2], cache[f"decoder.{layer}.attn.result"][:, 2], **EXACT)
    whole = cache.stack_head_results(incl_remainder=True).sum(0)
    torch.testing.assert_close(whole, _last(cache, "resid_post"), **EXACT)


def test_the_logit_attributions_sum_to_the_logits(run) -> None:  # noqa: ANN001
    loaded, logits, cache = run
    last = logits[:, -1]
    good, bad = last.argmax(-1), last.argmin(-1)  # (B,)
    stack = cache.decompose_resid()
    attrs = cache.logit_attrs(stack, good, incl_offset=True)  # a stack of every position, read at -1
    assert attrs.shape == (stack.shape[0] + 2, 2) and attrs.dtype == torch.float64
    torch.testing.assert_close(_before_cap(loaded, attrs.sum(0)), last.gather(-1, good[:, None])[:, 0], **EXACT)
    difference = cache.logit_attrs(stack, good, incorrect_tokens=bad, incl_offset=True).sum(0)
    expected = last.gather(-1, good[:, None]) - last.gather(-1, bad[:, None])
    if loaded.model.config.final_softcap is None:
        torch.testing.assert_close(difference, expected[:, 0], **EXACT)
    every = cache.logit_attrs(stack, cache.tokens, pos=None, incl_offset=True).sum(0)  # (B, T) each position's own
    torch.testing.assert_close(_before_cap(loaded, every), logits.gather(-1, cache.tokens[..., None])[..., 0], **EXACT)
    heads = cache.stack_head_results(incl_bias=True, incl_remainder=True, pos_slice=-1)
    torch.testing.assert_close(cache.logit_attrs(heads, good).sum(0), attrs[:-2].sum(0), **EXACT)


def test_the_frozen_final_norm_sums_to_its_site(run) -> None:  # noqa: ANN001
    _, _, cache = run
    normed = cache.apply_final_norm(cache.decompose_resid(pos_slice=-1), incl_bias=True)
    torch.testing.assert_close(normed.sum(0), cache["decoder.final_norm"][:, -1], **EXACT)
    every = cache.decompose_resid(apply_final_norm=True).sum(0)
    bias = cache.apply_final_norm(cache.decompose_resid(), pos=None, incl_bias=True)[-1]
    torch.testing.assert_close(every + bias, cache["decoder.final_norm"], **EXACT)


def test_a_head_attribution_is_direct_logit_attributions(run) -> None:  # noqa: ANN001
    loaded, _, _ = run
    answer = next(text for text in ("a", "e", "o") if len(continuation_ids(loaded, text)) == 1)
    _, cache = run_with_cache(loaded, TEXTS[0])
    token = continuation_ids(loaded, answer)[0]
    attrs = cache.logit_attrs(cache.stack_head_results(), answer)[:, 0]
    assert attrs.tolist() == pytest.approx(
        [h.contribution for h in direct_logit_attribution(loaded, TEXTS[0], answer).heads]
    )
    torch.testing.assert_close(attrs, cache.logit_attrs(cache.stack_head_results(), token)[:, 0], **EXACT)


def _readable_best(loaded, row: torch.Tensor) -> tuple[int, str]:  # noqa: ANN001
    """The most likely token whose text reads back as that one token (random models favour bytes
    that are no text alone)."""
    for token in row.argsort(descending=True).tolist():
        text = loaded.codec.decode([token])
        if text and continuation_ids(loaded, text) == [token]:
            return token, text
    raise AssertionError("no token reads back as itself")


def test_prompt_ranks_the_answer_among_the_logits(run, capsys) -> None:  # noqa: ANN001
    loaded, _, _ = run
    for prompt in ("the cat sat on", "hello world, the quick brown"):
        prompt_ids = loaded.task.encode(prompt)
        logits, _ = run_with_cache(loaded, prompt, names=["logits"])
        row = logits[0, -1]
        token, text = _readable_best(loaded, row)
        result = check_prompt(loaded, prompt, text, top_k=3, prepend_space=False)
        (found,) = result.answers
        probabilities = torch.softmax(row, -1)
        assert (found.id, found.position) == (token, len(prompt_ids) - 1)
        assert found.rank == int((row > row[token]).sum()) and (found.rank == 0) == (token == int(row.argmax()))
        assert found.logit == pytest.approx(float(row[token]), abs=1e-12)
        assert found.probability == pytest.approx(float(probabilities[token]), abs=1e-12)
        assert [c.id for c in found.top] == probabilities.topk(3).indices.tolist()
        assert found.top[0].probability == pytest.approx(float(probabilities.max()), abs=1e-12)
        greedy = check_prompt(loaded, prompt, [int(row.argmax())], top_k=1).answers[0]  # perhaps no text alone
        assert (greedy.rank, greedy.id) == (0, found.top[0].id)
        assert greedy.probability == pytest.approx(float(probabilities.max()), abs=1e-12)
    printed = capsys.readouterr().out
    assert "Rank: 0" in printed and "Top 2th token." in printed and printed.count("Performance on answer token") == 4

    several = check_prompt(loaded, prompt, "the end", top_k=2, print_details=False)
    ids = continuation_ids(loaded, " the end")
    assert [a.id for a in several.answers] == ids and len(ids) > 1
    full, _ = run_with_cache(loaded, [prompt_ids + ids], names=["logits"])
    for answer in several.answers:
        row = full[0, answer.position]
        assert answer.rank == int((row > row[answer.id]).sum())
        assert answer.logit == pytest.approx(float(row[answer.id]), abs=1e-12)


def test_bad_input_is_one_usage_error_naming_it(run) -> None:  # noqa: ANN001
    loaded, _, cache = run
    stack = cache.decompose_resid()
    vocabulary = loaded.model.config.vocab_size
    cases = {
        r"tokens: ' the end' is \d+ tokens": lambda: cache.logit_attrs(stack, " the end"),
        r"tokens: token id \d+ is out of range": lambda: cache.logit_attrs(stack, vocabulary),
        r"incorrect_tokens: token id -1 is out of range": lambda: cache.logit_attrs(stack, 3, incorrect_tokens=-1),
        r"tokens: ids of shape \(3,\) do not fit": lambda: cache.logit_attrs(stack, torch.tensor([1, 2, 3])),
        r"stack: parts of shape": lambda: cache.logit_attrs(stack[:, :, :2], 3),
        r"inputs: token id \d+ is out of range": lambda: run_with_cache(loaded, torch.tensor([[1, vocabulary]])),
        r"inputs: give a text, a list of texts, or token ids": lambda: run_with_cache(loaded, []),
        r"inputs: a batch of one type": lambda: run_with_cache(loaded, ["hi", [1, 2]]),
        r"is_token: only with ids": lambda: run_with_cache(loaded, "hi", is_token=torch.ones(1, 2)),
        r"names: site 'decoder.0.attn.nope'": lambda: run_with_cache(loaded, "hi", names=["decoder.0.attn.nope"]),
        r"site 'decoder.9.resid_pre': not in this cache": lambda: cache["decoder.9.resid_pre"],
        r"layer: 7 is out of range": lambda: cache.decompose_resid(layer=7),
        r"mode: unknown 'heads'": lambda: cache.decompose_resid(mode="heads"),
        r"pos_slice: position 99 is out of range": lambda: cache.accumulated_resid(pos_slice=99),
        r"top_k: 0 is out of range": lambda: check_prompt(loaded, "hi", "x", top_k=0, print_details=False),
        r"answer: '' is no tokens": lambda: check_prompt(loaded, "hi", "", print_details=False),
        r"answer: token id \d+ is out of range": lambda: check_prompt(loaded, "hi", [vocabulary], print_details=False),
    }
    for message, call in cases.items():
        with pytest.raises(UsageError, match=message):
            call()


def test_a_post_norm_stream_has_no_decomposition(tmp_path) -> None:  # noqa: ANN001
    path, _ = tiny_lm_run(tmp_path, model={"norm": "layer", "norm_placement": "post"})
    _, cache = run_with_cache(open_run(path), "the cat")
    assert cache.accumulated_resid().shape[0] == cache.layers + 1  # the streams are there to read
    for call in (
        cache.decompose_resid,
        cache.stack_head_results,
        lambda: cache.apply_final_norm(cache.accumulated_resid()),
    ):
        with pytest.raises(UsageError, match="norm placement 'post'"):
            call()
