"""``LanguageModel.importance`` of token ids: Michel et al.'s I_h from a batch of token ids, on a tiny random
Llama-style run in float64. It is the importance of ``attnlab heads importance`` on the same texts,
and each head's score is the mean over the rows of the central finite difference of the row's loss
in xi_h; padding on either side counts for nothing; parameters keep requiring gradients after it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from attnlab.analysis.heads import importance
from attnlab.analysis.lm_probe import NextTokenProbe
from attnlab.errors import UsageError
from attnlab.lm import LanguageModel
from attnlab.nn import masking_heads
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import PAD, tiny_lm_run

TEXTS = ["the cat sat on the mat", "a dog barked at it", "colourless green ideas"]


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    run, texts = tiny_lm_run(tmp_path_factory.mktemp("lm"), texts=TEXTS)
    loaded = open_run(run)
    loaded.model.double()
    return LanguageModel(loaded), texts


def _rows(lm: LanguageModel) -> list[list[int]]:
    return [lm.tokenize(text) for text in TEXTS]


def _padded(rows: list[list[int]], *, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    tokens = torch.full((len(rows), width), PAD)
    real = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if left else slice(0, len(row))
        tokens[i, span], real[i, span] = torch.tensor(row), True
    return tokens, real


def _row_loss(model, ids: list[int], xi: torch.Tensor) -> float:  # noqa: ANN001
    tokens = torch.tensor([ids])
    with masking_heads(model, {"self": xi}):
        logits = model(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))
    return float(F.cross_entropy(logits[0, :-1], tokens[0, 1:]))


def test_head_importance_of_ids_equals_the_importance_of_the_same_texts(lm) -> None:
    model, texts = lm
    expected = torch.zeros(model.head_mask_shapes["self"], dtype=torch.float64)
    for row in importance(NextTokenProbe(model.loaded, texts, batch_size=2)):
        expected[row.layer, row.head] = row.importance
    for left in (False, True):  # padding on either side is read past
        tokens, real = _padded(_rows(model), left=left)
        scores = model.importance(tokens, is_token=real, progress=False).tensor
        assert scores.shape == model.head_mask_shapes["self"]
        torch.testing.assert_close(scores, expected, rtol=1e-9, atol=1e-12)
    assert all(p.requires_grad for p in model.model.parameters())  # frozen for the pass only


def test_head_importance_equals_finite_differences_of_each_rows_loss(lm) -> None:
    model, _ = lm
    rows = [row[:12] for row in _rows(model)]
    scores = model.importance(torch.tensor(rows), progress=False).tensor
    layers, heads = model.head_mask_shapes["self"]
    eps = 1e-5
    expected = torch.zeros(layers, heads, dtype=torch.float64)
    with torch.no_grad():
        for layer in range(layers):
            for head in range(heads):
                for ids in rows:
                    up, down = (
                        torch.ones(layers, heads, dtype=torch.float64),
                        torch.ones(layers, heads, dtype=torch.float64),
                    )
                    up[layer, head] += eps
                    down[layer, head] -= eps
                    slope = (_row_loss(model.model, ids, up) - _row_loss(model.model, ids, down)) / (2 * eps)
                    expected[layer, head] += abs(slope) / len(rows)
    torch.testing.assert_close(scores, expected, rtol=1e-6, atol=1e-9)
    assert float(scores.min()) > 0


def test_bad_ids_are_refused_with_the_reason(lm) -> None:
    model, _ = lm
    with pytest.raises(UsageError, match="two real tokens"):
        model.importance(torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.tensor([[1, 1, 1], [0, 0, 1]]), progress=False)
    with pytest.raises(UsageError, match="integer tensor"):
        model.importance(torch.ones(2, 3), progress=False)
    with pytest.raises(UsageError, match=r"is_token: shape \(1, 2\) differs"):
        model.importance(torch.tensor([[5, 6, 7]]), torch.ones(1, 2), progress=False)
    with pytest.raises(UsageError, match="vocabulary|must lie"):
        model.importance(torch.tensor([[5, 6, 10**6]]), progress=False)
