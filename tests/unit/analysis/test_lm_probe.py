"""Head analysis of a language model with the next-token loss (Michel et al. on an LM): on a tiny
random Llama-style ``pretrained_lm`` run, the probe's loss equals an unpadded float64 reference,
importance equals central finite differences of each text's loss in xi_h, masking a head equals
zeroing its columns of W^O, and the physically pruned run computes the masked model."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.analysis.heads import ablate, heads_to_remove, importance, pruning_curve
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.analysis.pruning import prune_model, write_pruned_run
from attnlab.errors import DataError, UsageError
from attnlab.head_ids import mask_without
from attnlab.nn import masking_heads
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import PAD, TEXTS, tiny_lm_run


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    """The run (weights in float64, so that finite differences are exact enough) and its texts."""
    run, texts = tiny_lm_run(tmp_path_factory.mktemp("lm"))
    loaded = open_run(run)
    loaded.model.double()
    return loaded, texts


def _text_loss(model, ids: list[int], head_mask=None) -> torch.Tensor:  # noqa: ANN001
    """Mean -log p(x_t | x_<t) over t >= 2 of one unpadded text, computed from the logits."""
    tokens = torch.tensor([ids])
    with masking_heads(model, head_mask):
        logits = model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))
    return -F.log_softmax(logits[0, :-1], dim=-1).gather(1, tokens[0, 1:, None]).mean()


def _rows(loaded) -> list[list[int]]:  # noqa: ANN001
    return [ids for ids in map(loaded.task.encode, TEXTS) if len(ids) >= 2]


def test_the_loss_is_the_unpadded_next_token_nll_and_the_metric_the_perplexity(lm) -> None:
    loaded, texts = lm
    probe = NextTokenProbe(loaded, texts, batch_size=2)  # padded batches; the pad id is a real token
    rows = _rows(loaded)
    assert (probe.texts, probe.skipped, probe.tokens) == (len(rows), 1, sum(len(r) - 1 for r in rows))
    assert any(PAD in row for row in rows)
    with torch.no_grad():
        per_text = [float(_text_loss(loaded.model, ids)) for ids in rows]
        nll = sum(loss * (len(ids) - 1) for loss, ids in zip(per_text, rows)) / probe.tokens
        score = probe.evaluate(None)
        batch_losses = torch.cat([probe.example_losses(b, None) for b in probe.batches()])
    assert score.loss == pytest.approx(nll, abs=1e-10)
    assert score.metric == pytest.approx(math.exp(nll), rel=1e-10)
    assert sorted(batch_losses.tolist()) == pytest.approx(sorted(per_text), abs=1e-10)


def test_importance_equals_finite_differences_of_each_texts_loss(lm) -> None:
    loaded, texts = lm
    model = loaded.model
    probe = NextTokenProbe(loaded, texts, batch_size=2)
    scores = {(r.layer, r.head): r.importance for r in importance(probe)}
    layers, heads, eps = 2, 6, 1e-5
    with torch.no_grad():
        for layer in range(layers):
            for head in range(heads):
                slopes = []
                for ids in _rows(loaded):
                    masks = []
                    for sign in (1, -1):
                        xi = torch.ones(layers, heads, dtype=torch.float64)
                        xi[layer, head] += sign * eps
                        masks.append(_text_loss(model, ids, {"self": xi}))
                    slopes.append(abs(float(masks[0] - masks[1]) / (2 * eps)))
                assert scores[(layer, head)] == pytest.approx(sum(slopes) / len(slopes), rel=1e-6, abs=1e-9)
    assert min(scores.values()) > 0  # every head of the random model matters


def test_masking_a_head_equals_zeroing_its_columns_of_w_o(lm) -> None:
    loaded, texts = lm
    probe = NextTokenProbe(loaded, texts, batch_size=4)
    result = ablate(probe)
    d_v = loaded.model.config.head_dim_v
    for row in result.single[::5]:
        zeroed = copy.deepcopy(loaded.model)
        attention = zeroed.attention_sites()[row.layer].module
        with torch.no_grad():
            attention.out_proj.weight[:, row.head * d_v : (row.head + 1) * d_v] = 0
        other = copy.copy(probe)
        other.model = zeroed
        assert row.loss == pytest.approx(other.evaluate(None).loss, abs=1e-10)
        assert row.metric == pytest.approx(other.evaluate(None).metric, rel=1e-10)
        assert row.delta == pytest.approx(row.metric - result.baseline.metric)


def test_the_physically_pruned_run_computes_the_masked_model(lm, tmp_path) -> None:
    loaded, texts = lm
    probe = NextTokenProbe(loaded, texts, batch_size=3)
    curve = pruning_curve(probe, [50])
    held, chosen = heads_to_remove(probe, 50)
    assert held == [] and len(chosen) == 6
    smaller = prune_model(loaded.model, chosen)
    new_run = write_pruned_run(loaded, smaller, tmp_path / "pruned", pruned=chosen)
    reopened = open_run(new_run.path)
    assert reopened.model.config.kv_groups is not None
    reopened.model.double()
    pruned_probe = NextTokenProbe(reopened, texts, batch_size=3)
    assert pruned_probe.evaluate(None).loss == pytest.approx(curve[0].loss, abs=1e-10)
    mask = mask_without(loaded.model, chosen)
    with torch.no_grad():
        for batch in probe.batches():
            difference = probe.outputs(loaded.model, batch, mask) - probe.outputs(reopened.model, batch, None)
            assert difference.abs().max() < 1e-10


def test_a_text_longer_than_the_context_is_refused_or_cut(lm, tmp_path) -> None:
    loaded, _ = lm
    path = tmp_path / "long.txt"
    path.write_text("short text\n" + "z" * 80 + "\n", encoding="utf-8")  # 80 tokens > 64
    with pytest.raises(DataError, match=r"long\.txt:2: the text has 80 tokens.*context of 64"):
        NextTokenProbe(loaded, path)
    probe = NextTokenProbe(loaded, path, truncate=True)
    assert (probe.truncated, probe.tokens) == (1, 9 + 63)


def test_texts_without_a_next_token_and_other_runs_are_refused(lm, tmp_path) -> None:
    loaded, _ = lm
    path = tmp_path / "single.txt"
    path.write_text("a\nb\n", encoding="utf-8")
    with pytest.raises(DataError, match="no text of two tokens"):
        NextTokenProbe(loaded, path)
    from tests.unit.analysis.tiny_runs import tiny_run

    with pytest.raises(UsageError, match="needs a language model run of text"):
        NextTokenProbe(open_run(tiny_run(tmp_path, "encoder_classifier")), path)
