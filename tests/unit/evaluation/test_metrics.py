"""Metrics against hand-computed values, and sacrebleu's BLEU."""

from __future__ import annotations

import math

import pytest
import sacrebleu

from attnlab.evaluation import metrics


def test_sequence_and_token_accuracy():
    predictions = [[1, 2, 3], [1, 2], [4, 5, 6, 7]]
    references = [[1, 2, 3], [1, 2, 3], [4, 0, 6]]
    assert metrics.sequence_accuracy(predictions, references) == pytest.approx(1 / 3)
    assert metrics.token_accuracy(predictions, references) == pytest.approx((3 + 2 + 2) / 9)


def test_recognition_accuracy_and_length_bins():
    assert metrics.recognition_accuracy([1, 0, 1, 1], [1, 1, 1, 0]) == 0.5
    by_length = metrics.accuracy_by_length([True, False, True, True], [3, 3, 10, 2])
    assert by_length == {"2": 1.0, "3": 0.5, "10": 1.0}
    assert list(by_length) == ["2", "3", "10"]  # numeric order


def test_perplexity():
    assert metrics.perplexity(2 * math.log(4.0), 2) == pytest.approx(4.0)
    assert math.isnan(metrics.perplexity(1.0, 0))


def test_bleu_is_sacrebleu():
    hyps, refs = ["the cat sat on the mat", "a dog ran"], ["the cat sat on a mat", "a dog ran away"]
    assert metrics.bleu(hyps, refs) == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    assert metrics.bleu(refs, refs) == pytest.approx(100.0)


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        metrics.sequence_accuracy([[1], [2]], [[1]])
