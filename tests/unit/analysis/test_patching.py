"""Activation patching (attnlab.analysis.patching) and mean ablation on tiny runs: every reported
number equals an independent trace by hand, whole-residual patches restore exactly 1, errors are
clear."""

from __future__ import annotations

import pytest
import torch

from attnlab.analysis.fidelity import FidelityProbe
from attnlab.analysis.heads import ablate
from attnlab.analysis.patching import head_means, patch
from attnlab.errors import UsageError
from attnlab.nn.hooks import trace
from attnlab.pretrained.bert import find_source, import_bert
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_runs import tiny_run
from tests.unit.pretrained.tiny_bert import write_tiny_bert

CLEAN, CORRUPT = "the cat sat", "the mat sat"


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return open_run(tiny_run(tmp_path_factory.mktemp("patch-lm"), "decoder_only"))


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    folder = tmp_path_factory.mktemp("patch-bert")
    import_bert(find_source(write_tiny_bert(folder / "src", initializer_range=0.1)), folder / "run")
    return open_run(folder / "run")


def _tokens(loaded, text):
    return torch.tensor([loaded.task.generation_prompt(text)])


def _logit_diff(loaded, tokens, good, bad):
    logits = loaded.model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))[:, -1]
    return float(logits[0, good] - logits[0, bad])


def test_a_head_patch_equals_a_trace_by_hand(lm):
    result = patch(lm, CLEAN, CORRUPT, metric="logit_diff", answer="a", wrong="o")
    good, bad = lm.codec.encode("a")[0], lm.codec.encode("o")[0]
    clean, corrupt = _tokens(lm, CLEAN), _tokens(lm, CORRUPT)
    with torch.no_grad():
        m_clean, m_corrupt = _logit_diff(lm, clean, good, bad), _logit_diff(lm, corrupt, good, bad)
        assert result.metric_clean == pytest.approx(m_clean, abs=1e-5)
        assert result.metric_corrupt == pytest.approx(m_corrupt, abs=1e-5)
        with trace(lm.model, cache="decoder.1.attn.z") as seen:
            lm.model(clean, is_token=torch.ones_like(clean, dtype=torch.bool))
        with trace(lm.model) as t:
            t.replace("decoder.1.attn.z", seen.cache["decoder.1.attn.z"], heads=[1])
            m_patched = _logit_diff(lm, corrupt, good, bad)
    heads = result.groups["heads"]
    (row,) = [r for r in heads if (r.layer, r.head) == (1, 1)]
    assert row.metric == pytest.approx(m_patched, abs=1e-5)
    assert row.restored == pytest.approx((m_patched - m_corrupt) / (m_clean - m_corrupt), abs=1e-4)
    assert len(heads) == 2 * 2 and {r.kind for r in heads} == {"self"} and {r.position for r in heads} == {None}
    assert result.measure == "logit['a'] - logit['o'] at the last position"


def test_patching_the_whole_residual_or_the_last_position_restores_everything(lm):
    result = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", sites=["residual"])
    positions, residual = len(result.corrupt_tokens), result.groups["residual"]
    assert list(result.groups) == ["residual"]
    assert len(residual) == 3 * positions  # resid_pre of 2 layers and the last resid_post
    # The last position's logits read only the last position's final residual: patching it is the clean run.
    last = [r for r in residual if r.point == "resid_post" and r.position == positions - 1]
    assert last[0].restored == pytest.approx(1.0, abs=1e-5)
    # A position whose token is the same in both inputs, before any layer mixed them: nothing to restore.
    same = [r for r in residual if r.layer == 0 and r.point == "resid_pre" and r.token == "t"]
    assert same and all(abs(r.restored) < 1e-6 for r in same)
    with torch.no_grad(), trace(lm.model, cache="decoder.0.resid_pre") as seen:  # all positions at once
        clean = _tokens(lm, CLEAN)
        lm.model(clean, is_token=torch.ones_like(clean, dtype=torch.bool))
    good, bad = lm.codec.encode("a")[0], lm.codec.encode("o")[0]
    with torch.no_grad(), trace(lm.model) as t:
        t.replace("decoder.0.resid_pre", seen.cache["decoder.0.resid_pre"])
        assert _logit_diff(lm, _tokens(lm, CORRUPT), good, bad) == pytest.approx(result.metric_clean, abs=1e-5)


def test_a_sentence_encoder_measures_the_cosine_to_the_clean_embedding(bert):
    result = patch(bert, "the cat sat on the mat.", "the dog sat on the mat.")
    assert result.metric_clean == pytest.approx(1.0, abs=1e-6) and result.metric_corrupt < 0.9999
    assert result.measure == "cosine to the clean embedding"
    last_layer = max(r.layer for r in result.groups["residual"])
    outputs = [r for r in result.groups["residual"] if r.point == "resid_post" and r.layer == last_layer]
    assert len(outputs) == len(result.corrupt_tokens)
    assert sum(r.restored for r in outputs) != pytest.approx(0.0)


def test_patching_errors_are_clear(lm, bert, tmp_path):
    with pytest.raises(UsageError, match=r"same number of tokens: clean has \d+ \(.*\), corrupt has \d+ \(.*\)"):
        patch(lm, CLEAN, "the cats sat")
    with pytest.raises(UsageError, match=r"--answer: 'at' is 2 tokens"):
        patch(lm, CLEAN, CORRUPT, answer="at", wrong="o")
    with pytest.raises(UsageError, match=r"both lead to 'a'"):
        patch(lm, CLEAN, CORRUPT, answer="a", wrong="a")
    with pytest.raises(UsageError, match=r"measures both alike"):
        patch(bert, "the cat sat.", "the cat sat.")
    for given in ({"answer": "cat"}, {"wrong": "mat"}):  # a sentence encoder measures no next token
        flag = "--" + next(iter(given))
        with pytest.raises(UsageError, match=f"{flag}: only for a language model.*this run is a sentence encoder"):
            patch(bert, "the cat sat.", "the mat sat.", **given)
    with pytest.raises(UsageError, match=r"--metric: unknown 'kl'"):
        patch(lm, CLEAN, CORRUPT, metric="kl")
    seq2seq = open_run(tiny_run(tmp_path / "s2s", "encoder_decoder"))
    with pytest.raises(UsageError, match=r"this run's model is 'encoder_decoder'"):
        patch(seq2seq, "abc", "abd")


def test_mean_ablation_with_zero_means_is_zero_ablation_and_the_means_are_the_mean_outputs(bert, tmp_path):
    texts = tmp_path / "texts.txt"
    lines = ["the cat sat on the mat.", "a big red house", "they run fast"]
    texts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    means = head_means(bert, texts)
    # By hand: every position of every text, each alone.
    with torch.no_grad():
        outputs = []
        for line in lines:
            with trace(bert.model, cache="encoder.1.attn.z") as seen:
                bert.model(torch.tensor([bert.codec.encode(line)]))
            outputs.append(
                seen.cache["encoder.1.attn.z"][0].transpose(0, 1).reshape(-1, *means["encoder.1.attn.z"].shape)
            )
    expected = torch.cat(outputs).double().mean(0)
    assert torch.allclose(means["encoder.1.attn.z"].double(), expected, atol=1e-6)
    probe = FidelityProbe(bert, texts, batch_size=2)
    zero = ablate(probe)
    as_zero = ablate(probe, means={name: torch.zeros_like(m) for name, m in means.items()})
    for a, b in zip(zero.single + zero.keep_one, as_zero.single + as_zero.keep_one, strict=True):
        assert (a.kind, a.layer, a.head) == (b.kind, b.layer, b.head)
        assert a.metric == pytest.approx(b.metric, abs=1e-6) and a.loss == pytest.approx(b.loss, abs=1e-6)
    mean = ablate(probe, means=means)
    assert any(abs(a.metric - b.metric) > 1e-4 for a, b in zip(zero.single, mean.single, strict=True))
