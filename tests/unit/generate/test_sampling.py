"""Sampling's warpers: top-k and top-p keep what Hugging Face's keep, in its order."""

from __future__ import annotations

import pytest
import torch

from attnlab.generate.sampling import SamplingOptions, top_k_filter, top_p_filter, warp_logits


def _kept(logits: torch.Tensor) -> list[list[int]]:
    return [sorted(torch.nonzero(row > float("-inf"))[:, 0].tolist()) for row in logits]


def test_top_k_keeps_the_k_largest_logits():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.5], [0.0, -1.0, 5.0, 5.0, 2.0]])
    assert _kept(top_k_filter(logits, 2)) == [[1, 2], [2, 3]]
    assert _kept(top_k_filter(logits, 1)) == [[1], [2, 3]]  # a tie with the k-th stays, as in Hugging Face
    assert torch.equal(top_k_filter(logits, 0), logits) and torch.equal(top_k_filter(logits, 5), logits)
    kept = top_k_filter(logits, 3)
    assert torch.equal(kept[kept > float("-inf")], logits[kept > float("-inf")])  # kept logits unchanged


@pytest.mark.parametrize(
    ("p", "kept"),
    [(0.4, [0]), (0.5, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, kept):
    """Probabilities 0.5, 0.3, 0.15, 0.05: the fewest most probable tokens whose sum is >= p."""
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    assert _kept(top_p_filter(logits, p)) == [kept]


def test_top_p_always_keeps_the_most_probable_token():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.0, 9.0]])
    assert _kept(top_p_filter(logits, 1e-9)) == [[0], [2]]


def test_warpers_equal_hugging_face_on_random_logits():
    transformers = pytest.importorskip("transformers")
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 50, generator=generator) * 3
    for options in (
        SamplingOptions(temperature=0.7, top_k=5),
        SamplingOptions(temperature=1.3, top_p=0.9),
        SamplingOptions(temperature=1.0, top_k=10, top_p=0.5),
        SamplingOptions(temperature=2.0, top_p=0.01),
    ):
        theirs = logits / options.temperature
        if options.top_k:
            theirs = transformers.TopKLogitsWarper(options.top_k)(None, theirs)
        if options.top_p < 1:
            theirs = transformers.TopPLogitsWarper(options.top_p)(None, theirs)
        assert torch.equal(warp_logits(logits, options), theirs), options
