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
from attnlab.nn.trace import trace
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


def test_every_head_patch_over_all_positions_equals_a_trace_by_hand(lm):
    result = patch(lm, CLEAN, CORRUPT, metric="logit_diff", answer="a", wrong="o", sites=["heads"])
    good, bad = lm.codec.encode("a")[0], lm.codec.encode("o")[0]
    clean, corrupt = _tokens(lm, CLEAN), _tokens(lm, CORRUPT)
    with torch.no_grad(), trace(lm.model, cache="decoder.*.attn.z") as seen:
        lm.model(clean, is_token=torch.ones_like(clean, dtype=torch.bool))
    for row in result.groups["heads"]:
        with torch.no_grad(), trace(lm.model) as t:
            t.replace(row.site, seen.cache[row.site], heads=[row.head])
            assert row.metric == pytest.approx(_logit_diff(lm, corrupt, good, bad), abs=1e-5)


def test_patching_a_whole_site_restores_one_and_a_slice_the_inputs_share_restores_zero(lm):
    # Every site at position 0 (BOS, before the inputs differ, in a causal model): clean = corrupt there.
    each = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", sites=["*"], positions="each")
    rows = each.groups["*"]
    names = {r.site for r in rows}
    assert {"decoder.0.attn.q_pre", "decoder.1.attn_norm.scale", "decoder.1.ffn.pre", "logits"} <= names
    first = [r for r in rows if r.position == 0]
    assert len(first) > len(names) and all(r.restored == pytest.approx(0.0, abs=1e-5) for r in first)  # float32 batches
    # A site that carries the whole input to the output, patched at every position, restores 1.
    whole = ["decoder.*.resid_pre", "decoder.1.resid_post", "decoder.final_norm*", "logits"]
    result = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", sites=whole, positions="all")
    for request in whole:
        for row in result.groups[request]:
            assert row.position is None and row.restored == pytest.approx(1.0, abs=1e-6), row


def test_a_metric_function_of_the_logits_gives_what_the_named_metric_gives(lm):
    good, bad = lm.codec.encode("a")[0], lm.codec.encode("o")[0]

    def margin(logits: torch.Tensor) -> torch.Tensor:  # (B, T, V) -> (B,)
        return logits[:, -1, good] - logits[:, -1, bad]

    named = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", sites=["heads", "*.ffn.out"])
    given = patch(lm, CLEAN, CORRUPT, metric=margin, sites=["heads", "*.ffn.out"])
    assert given.measure == "margin" and given.metric_clean == named.metric_clean
    for request in ("heads", "*.ffn.out"):
        assert [r.restored for r in given.groups[request]] == [r.restored for r in named.groups[request]]
    with pytest.raises(UsageError, match=r"metric: must map the output \(1, \.\.\.\) to \(1,\)"):
        patch(lm, CLEAN, CORRUPT, metric=lambda logits: logits[:, -1])
    with pytest.raises(UsageError, match="--answer: only for a language model's named metrics.*a metric function"):
        patch(lm, CLEAN, CORRUPT, metric=margin, answer="a")


def test_the_log_probability_of_a_several_token_answer_is_summed_teacher_forced(lm):
    answer = "at"  # two characters: two tokens
    ids = lm.codec.encode(answer)
    assert len(ids) == 2
    result = patch(lm, CLEAN, CORRUPT, metric="logprob", answer=answer, sites=["residual"])
    assert result.clean_tokens[-1] == "a" and len(result.clean_tokens) == len(_tokens(lm, CLEAN)[0]) + 1
    for text, measured in ((CLEAN, result.metric_clean), (CORRUPT, result.metric_corrupt)):
        prompt = _tokens(lm, text)[0].tolist()
        by_hand = 0.0
        with torch.no_grad():
            for step, token in enumerate(ids):  # p(a_i | prompt, a_<i), one forward pass each
                tokens = torch.tensor([prompt + ids[:step]])
                logits = lm.model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))[0, -1]
                by_hand += float(torch.log_softmax(logits.double(), -1)[token])
        assert measured == pytest.approx(by_hand, abs=1e-5)
    assert result.measure == "log p('a' 't') after the prompt, teacher-forced (2 tokens)"
    one = patch(lm, CLEAN, CORRUPT, metric="logprob", answer="a", sites=["heads"])  # one token: the loss metric
    loss = patch(lm, CLEAN, CORRUPT, metric="loss", answer="a", sites=["heads"])
    assert one.metric_clean == pytest.approx(loss.metric_clean, abs=1e-6)
    with pytest.raises(UsageError, match=r"--answer: '' is no token"):
        patch(lm, CLEAN, CORRUPT, metric="logprob", answer="")


def test_attribution_reports_exact_values_for_its_top_units_and_bad_choices_are_clear(lm):
    result = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", method="attribution", verify_top=3)
    verified = []
    for rows in result.groups.values():  # the 3 largest |estimates| of each request
        verified += [r for r in rows if r.exact is not None]
        largest = sorted(rows, key=lambda r: -abs(r.restored))[:3]
        assert {(r.site, r.head, r.position) for r in rows if r.exact is not None} == {
            (r.site, r.head, r.position) for r in largest
        }
    assert len(verified) == 2 * 3 and result.method == "attribution"
    exact = patch(lm, CLEAN, CORRUPT, answer="a", wrong="o")
    by_unit = {(r.site, r.head, r.position): r.restored for group in exact.groups.values() for r in group}
    for row in verified:
        assert row.exact == pytest.approx(by_unit[(row.site, row.head, row.position)], abs=1e-5)
        assert row.metric == pytest.approx(
            result.metric_corrupt + row.restored * (result.metric_clean - result.metric_corrupt)
        )
    for kwargs, message in (
        ({"method": "grad"}, "--method: unknown 'grad'"),
        ({"positions": "some"}, "--positions: unknown 'some'"),
        ({"sites": ["decoder.0.attn.zz"]}, r"--site: site 'decoder.0.attn.zz': no such site.*did you mean"),
        ({"verify_top": -1}, "--verify-top: must be 0 or more"),
    ):
        with pytest.raises(UsageError, match=message):
            patch(lm, CLEAN, CORRUPT, answer="a", wrong="o", **kwargs)
