"""Evaluation metrics: exact match, per-token and recognition accuracy, perplexity, BLEU, and
accuracy per length bin (so that length generalisation is visible)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import sacrebleu

__all__ = [
    "sequence_accuracy",
    "token_accuracy",
    "token_accuracy_per_sequence",
    "recognition_accuracy",
    "perplexity",
    "bleu",
    "accuracy_by_length",
    "examples_by_length",
]


def sequence_accuracy(predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Fraction of sequences predicted exactly (same tokens, same length)."""
    _check_pairs(predictions, references)
    return _mean([list(p) == list(r) for p, r in zip(predictions, references)])


def token_accuracy(predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]]) -> float:
    """Fraction of reference positions whose token the prediction has at the same position."""
    _check_pairs(predictions, references)
    correct = sum(sum(1 for i, t in enumerate(r) if i < len(p) and p[i] == t) for p, r in zip(predictions, references))
    total = sum(len(r) for r in references)
    return correct / total if total else float("nan")


def token_accuracy_per_sequence(
    predictions: Sequence[Sequence[int]], references: Sequence[Sequence[int]]
) -> list[float]:
    """Each sequence's fraction of reference positions predicted right (Delétang et al. 2023).

    For sequence j, (1/|y_j|) sum_i [yhat_{j,i} = y_{j,i}] over the reference's positions i (a
    prediction shorter than the reference misses the rest); the paper's score is the mean of these
    over sequences, which weighs every sequence alike, unlike :func:`token_accuracy`, which pools
    the tokens. An empty reference scores 1 if the prediction is empty too, else 0.
    """
    _check_pairs(predictions, references)
    return [_fraction_right(p, r) for p, r in zip(predictions, references)]


def _fraction_right(prediction: Sequence[int], reference: Sequence[int]) -> float:
    if not reference:
        return float(not prediction)
    return sum(1 for i, t in enumerate(reference) if i < len(prediction) and prediction[i] == t) / len(reference)


def recognition_accuracy(predicted_labels: Sequence[int], labels: Sequence[int]) -> float:
    """Fraction of strings classified correctly as in / not in the language (Hahn §3)."""
    _check_pairs(predicted_labels, labels)
    return _mean([int(p) == int(t) for p, t in zip(predicted_labels, labels)])


def perplexity(total_nll: float, total_tokens: int) -> float:
    """exp(mean negative log-likelihood per token)."""
    if total_tokens <= 0:
        return float("nan")
    return math.exp(min(total_nll / total_tokens, 700.0))


def bleu(hypotheses: Sequence[str], references: Sequence[str]) -> float:
    """Corpus BLEU (sacrebleu, default 13a tokenization), 0-100."""
    _check_pairs(hypotheses, references)
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def accuracy_by_length(correct: Sequence[bool | float], lengths: Sequence[int]) -> dict[str, float]:
    """Accuracy per exact length, keyed by the length as a string (JSON-friendly), sorted.

    ``correct`` holds each example's score: right or wrong, or a fraction (a sequence's share of
    tokens right, :func:`token_accuracy_per_sequence`)."""
    _check_pairs(correct, lengths)
    groups: dict[int, list[float]] = {}
    for ok, length in zip(correct, lengths):
        groups.setdefault(int(length), []).append(float(ok))
    return {str(length): _mean(groups[length]) for length in sorted(groups)}


def examples_by_length(lengths: Sequence[int]) -> dict[str, int]:
    """How many examples each length has, keyed as :func:`accuracy_by_length` keys it, sorted."""
    counts: dict[int, int] = {}
    for length in lengths:
        counts[int(length)] = counts.get(int(length), 0) + 1
    return {str(length): counts[length] for length in sorted(counts)}


def _mean(values: Sequence[bool | float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _check_pairs(a: Sequence[object], b: Sequence[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"metrics: {len(a)} predictions for {len(b)} references")
