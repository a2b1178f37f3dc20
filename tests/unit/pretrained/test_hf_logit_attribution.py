"""Direct logit attribution, the logit lens and the head detectors on every Hugging Face family
attnlab opens (the tiny models of tiny_hf.py, float64): the contributions plus the untouched terms
sum to the logit exactly, the lens's last row is the model's output, every head is scored."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.analysis.detectors import detect_heads
from attnlab.analysis.logit_attribution import direct_logit_attribution, logit_lens
from attnlab.analysis.maps import answer_token, continuation_ids
from attnlab.nn import trace
from attnlab.pretrained.sources import open_model
from tests.unit.pretrained.tiny_hf import LAYERS, SIZES, TEXTS, build

pytest.importorskip("transformers")

PROMPT = TEXTS[0]


@pytest.fixture(scope="module", params=sorted(SIZES))
def loaded(request, tmp_path_factory):  # noqa: ANN001
    folder = tmp_path_factory.mktemp(request.param)
    build(request.param, folder)
    return open_model(folder, dtype="float64")


def _answers(loaded) -> tuple[str, str]:  # noqa: ANN001
    """Two single-token texts of the tiny tokenizer."""
    vocabulary = loaded.codec.vocabulary()
    singles = [text for text in ("e", "o", "a", "t") if text in vocabulary]
    return singles[0], singles[1]


def vocabulary_id(loaded, text: str) -> int:  # noqa: ANN001
    return loaded.codec.vocabulary()[text]


def _last_logits(loaded, text: str) -> torch.Tensor:  # noqa: ANN001
    ids = torch.tensor([loaded.task.generation_prompt(text)])
    with torch.no_grad():
        return loaded.model(ids, is_token=torch.ones_like(ids, dtype=torch.bool))[0, -1]


def _before_cap(loaded, value: float) -> float:  # noqa: ANN001
    cap = loaded.model.config.final_softcap
    return value if cap is None else cap * math.atanh(value / cap)


def test_the_contributions_sum_to_the_logit(loaded) -> None:  # noqa: ANN001
    answer, wrong = _answers(loaded)
    logits = _last_logits(loaded, PROMPT)
    good = vocabulary_id(loaded, answer)
    bad = vocabulary_id(loaded, wrong)
    one = direct_logit_attribution(loaded, PROMPT, answer)
    assert one.value == pytest.approx(float(logits[good]), abs=1e-9)
    assert one.total == pytest.approx(_before_cap(loaded, one.value), abs=1e-5)
    assert sum(t.contribution for t in one.terms) == pytest.approx(one.total, abs=1e-12)
    heads = loaded.model.head_mask_shapes()["self"]
    assert len(one.heads) == heads[0] * heads[1] and len(one.layers) == LAYERS
    assert all(abs(h.contribution) > 0 for h in one.heads)  # random heads all write towards the answer
    difference = direct_logit_attribution(loaded, PROMPT, answer, wrong)
    assert difference.value == pytest.approx(float(logits[good] - logits[bad]), abs=1e-9)
    if loaded.model.config.final_softcap is None:
        assert difference.total == pytest.approx(difference.value, abs=1e-5)


def test_a_head_contribution_is_its_result_through_the_frozen_final_norm(loaded) -> None:  # noqa: ANN001
    """For a pre-norm model, one head's term by hand: result . C(g * W_U[a] / sigma)."""
    config = loaded.model.config
    if config.placement != "pre":
        pytest.skip("branch norms come between a head and the residual")
    answer, _ = _answers(loaded)
    good = vocabulary_id(loaded, answer)
    ids = torch.tensor([loaded.task.generation_prompt(PROMPT)])
    last = f"decoder.{LAYERS - 1}.resid_post"
    with torch.no_grad(), trace(loaded.model, cache=["decoder.1.attn.result", last]) as t:
        loaded.model(ids, is_token=torch.ones_like(ids, dtype=torch.bool))
    residual = t.cache[last][0, -1]
    norm = loaded.model.decoder.final_norm
    centred = residual - residual.mean() if config.norm == "layer" else residual
    sigma = torch.sqrt(centred.pow(2).mean() + norm.eps)
    gain = (1.0 + norm.weight if config.norm == "rms_one_plus" else norm.weight).detach()
    result = t.cache["decoder.1.attn.result"][0, 2, -1]
    written = result - result.mean() if config.norm == "layer" else result
    expected = float((gain * written / sigma) @ loaded.model.lm_head.weight[good].detach())
    (row,) = [h for h in direct_logit_attribution(loaded, PROMPT, answer).heads if (h.layer, h.head) == (1, 2)]
    assert row.contribution == pytest.approx(expected, abs=1e-10)


def test_the_lens_last_row_is_the_model_output(loaded) -> None:  # noqa: ANN001
    answer, _ = _answers(loaded)
    good = vocabulary_id(loaded, answer)
    lens = logit_lens(loaded, PROMPT, answer=answer, top_k=3)
    assert [row.layer for row in lens.rows] == list(range(LAYERS + 1))
    logits = _last_logits(loaded, PROMPT)
    last = lens.rows[-1]
    assert last.site == "resid_post" and last.answer_logit == pytest.approx(float(logits[good]), abs=1e-6)
    assert last.answer_rank == int((logits > logits[good]).sum()) + 1
    assert last.answer_probability == pytest.approx(float(torch.softmax(logits, -1)[good]), abs=1e-6)
    assert lens.top_probabilities.shape == (LAYERS + 1, len(lens.tokens))


def test_every_head_is_scored(loaded) -> None:  # noqa: ANN001
    detection = detect_heads(loaded, batch=2)
    layers, heads = loaded.model.head_mask_shapes()["self"]
    assert len(detection.rows) == layers * heads and detection.notes == []
    for row in detection.rows:
        for name in ("previous_token", "duplicate_token", "induction", "bos", "positional"):
            assert 0.0 <= getattr(row, name) <= 1.0 + 1e-9


def test_an_answer_is_read_as_a_continuation_without_the_models_bos(loaded) -> None:  # noqa: ANN001
    """Patching's and attribution's --answer: one token of the vocabulary on every family, also
    where the model puts a BOS before a prompt (which once made every answer two tokens)."""
    answer, wrong = _answers(loaded)
    assert answer_token(loaded, answer, "--answer") == vocabulary_id(loaded, answer)
    assert continuation_ids(loaded, answer + wrong) == [vocabulary_id(loaded, answer), vocabulary_id(loaded, wrong)]
