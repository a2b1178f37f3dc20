"""Evaluation metrics: exact match, per-token and recognition accuracy, perplexity, BLEU, and
accuracy per length bin (so that length generalisation is visible)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import sacrebleu

__all__ = [
    "sequence_accuracy",
    "token_accuracy",
    "recognition_accuracy",
    "perplexity",
    "bleu",
    "accuracy_by_length",
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


def accuracy_by_length(correct: Sequence[bool], lengths: Sequence[int]) -> dict[str, float]:
    """Accuracy per exact length, keyed by the length as a string (JSON-friendly), sorted."""
    _check_pairs(correct, lengths)
    groups: dict[int, list[bool]] = {}
    for ok, length in zip(correct, lengths):
        groups.setdefault(int(length), []).append(bool(ok))
    return {str(length): _mean(groups[length]) for length in sorted(groups)}


def _mean(values: Sequence[bool]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _check_pairs(a: Sequence[object], b: Sequence[object]) -> None:
    if len(a) != len(b):
        raise ValueError(f"metrics: {len(a)} predictions for {len(b)} references")
