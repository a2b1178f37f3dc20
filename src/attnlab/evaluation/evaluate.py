"""Evaluate a model on a task split: the metrics of each kind of task, and accuracy per length.

Every result has ``accuracy`` (the task's headline metric: exact-match sequence accuracy for
seq2seq, recognition accuracy, all-tokens-right for language modelling), its binomial standard
error ``accuracy_se`` (sqrt(p (1 - p) / n), :func:`attnlab.evaluation.horizon.binomial_se`), ``loss``
(teacher-forced cross-entropy per prediction), ``accuracy_by_length`` and ``examples_by_length``
(strings per length). A split held out by length (length generalisation, a length or depth bin)
adds ``length_range`` ([low, high]), ``absent_lengths`` (lengths of the range without strings: the
task draws every length it has, so these are the lengths the language has none of, such as the odd
lengths of a Dyck language read by ``next_char``), and the generalisation horizon ``horizon`` at
``horizon_threshold`` (:mod:`attnlab.evaluation.horizon`; the task's ``horizon_threshold``).

With ``positions_seed`` (``train.eval_positions = "randomized"``), a model trained with randomized
positions (``model.randomized_positions = M``, Ruoss et al. 2023) is evaluated with positions drawn
as in training, a sorted random subset of [0, M) per sequence, from a generator of the sequence's
own seeded from ``positions_seed``, the split's name and the sequence's tokens
(:func:`attnlab.nn.token_positions.drawing_positions`): the same positions at every evaluation and in any
batch, and torch's global generator (the training one) is never drawn from. An encoder-decoder's
generated output takes the positions drawn for BOS + the reference output, one per token written
(:func:`attnlab.nn.token_positions.planned_positions`; Ruoss et al.'s model is given the output's length).

Recognition in the ``next_char`` formulation (a decoder-only model, batches with ``next_symbols``):
``accuracy`` is the share of strings whose every position predicts its next-symbol set exactly
(threshold 0.5, Bhattamishra et al. 2020), ``token_accuracy`` the share of positions, ``loss`` the
binary cross-entropy per position (summed over EOS and the symbols). A task with ``split_report`` (the formal languages)
adds its split's statistics (distinct strings, positives) and a shortcut baseline's accuracy.

A seq2seq result also has ``sequence_accuracy`` (exact match) and ``token_accuracy_per_sequence``
(each sequence's share of output tokens right, averaged over sequences: Delétang et al. 2023). A
task whose ``headline_metric`` is ``token_accuracy_per_sequence`` (the Chomsky-hierarchy tasks,
:mod:`attnlab.tasks.chomsky`) reports that as ``accuracy`` and per length; one with
``scores_terminator`` counts EOS as the last output token, as the paper scores its termination
symbol.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab.devices import model_device
from attnlab.evaluation import metrics
from attnlab.evaluation.horizon import DEFAULT_THRESHOLD, binomial_se, horizon
from attnlab.evaluation.objectives import FIRST_PREDICTED_ID, OBJECTIVES, next_symbol_targets
from attnlab.generate.search import DecodeOptions, decode
from attnlab.kernels.linear import packed_weights
from attnlab.nn import MODELS, masking_heads
from attnlab.nn.token_positions import drawing_positions, planned_positions
from attnlab.tasks.base import Example
from attnlab.tasks.batching import Batch, make_batches
from attnlab.tokenizers import Tokenizer

__all__ = ["evaluate", "next_symbol_hits"]


@torch.no_grad()
@packed_weights()  # batch after batch of the same weights: oneDNN's packed copies, dropped at the end
def evaluate(
    model: nn.Module,
    task: Any,
    split: str,
    *,
    kind: str,
    batch_size: int = 128,
    max_length: int | None = None,
    truncate: bool = False,
    tokenizer: Tokenizer | None = None,
    head_mask: Mapping[str, Tensor] | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
    positions_seed: int | None = None,
) -> dict[str, Any]:
    """Metrics of ``model`` on ``task.split(split)``.

    Args:
        kind: the model kind (``encoder_decoder``, ``encoder_classifier``, ``decoder_only``).
        tokenizer: for text tasks: BLEU is computed on decoded text.
        head_mask: evaluate with these heads masked (Michel §2.3).
        device: where the batches go; default: the model's device.
        positions_seed: evaluate with randomized positions drawn from a generator seeded from it
            (see the module docstring); None: positions 0, 1, ...
    """
    device = model_device(model) if device is None else device
    examples = task.split(split)
    if not examples:
        return {"split": split, "examples": 0}
    was_training = model.training
    model.eval()
    batches = make_batches(
        examples,
        batch_size,
        pad_id=task.pad_id,
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        shuffle=False,
        bucket=True,
        max_length=max_length,
        truncate=truncate,
    )
    totals = {"loss": 0.0, "count": 0}
    correct: list[bool] | list[float] = []  # per example: right, or its share of tokens right
    lengths: list[int] = []
    extra = _Accumulator()
    context = _Context(task, head_mask, tokenizer, _decode_limit(examples, text=tokenizer is not None))
    objective = OBJECTIVES[kind]
    total_batches = (len(examples) + batch_size - 1) // batch_size
    with drawing_positions(model, _positions_seed(positions_seed, split)):
        for batch in tqdm(batches, total=total_batches, desc=f"eval {split}", disable=not progress, leave=False):
            batch = batch.to(device)
            parts = objective(model, batch, head_mask, task.pad_id, 0.0)
            totals["loss"] += float(parts.total)
            totals["count"] += int(parts.count)
            correct.extend(_SCORERS[kind](model, batch, context, extra))
            lengths.extend(batch.split_lengths.tolist())
    model.train(was_training)
    accuracy = sum(correct) / len(correct)
    result: dict[str, Any] = {
        "split": split,
        "examples": len(correct),
        "loss": totals["loss"] / max(1, totals["count"]),
        "accuracy": accuracy,
        "accuracy_se": binomial_se(accuracy, len(correct)),
        "accuracy_by_length": metrics.accuracy_by_length(correct, lengths),
        "examples_by_length": metrics.examples_by_length(lengths),
    }
    if positions_seed is not None:
        result["positions"] = "randomized"
    result.update(_length_report(task, split, result["accuracy_by_length"]))
    next_char = getattr(task, "kind", None) == "next_char"
    if MODELS[kind][0].has_perplexity and not next_char:  # a binary cross-entropy has no perplexity
        result["perplexity"] = metrics.perplexity(totals["loss"], totals["count"])
    result.update(extra.summary())
    report = getattr(task, "split_report", None)  # split statistics and a shortcut's accuracy
    if report is not None:
        result.update(report(split, examples))
    return result


def _positions_seed(seed: int | None, split: str) -> int | None:
    """The seed randomized evaluation positions are drawn from: from ``seed`` and the split's name
    (SHA-256, the same in every process), so each split gets its own, fixed draws."""
    if seed is None:
        return None
    digest = hashlib.sha256(f"{seed}\x00positions\x00{split}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def _length_report(task: Any, split: str, by_length: Mapping[str, float]) -> dict[str, Any]:
    """For a split held out by length: its range, the lengths without strings, and the horizon."""
    held_out = getattr(task, "held_out_by_length", None)
    if held_out is None or not held_out(split):
        return {}
    span = task.lengths(split)
    accuracies = {int(n): a for n, a in by_length.items()}
    threshold = float(getattr(task, "horizon_threshold", DEFAULT_THRESHOLD))
    return {
        "length_range": [span.start, span.stop - 1],
        "absent_lengths": [n for n in span if n not in accuracies],
        "horizon": horizon(accuracies, threshold, span.start),
        "horizon_threshold": threshold,
    }


@dataclass(frozen=True)
class _Context:
    """What every batch of one evaluation is scored with."""

    task: Any
    head_mask: Mapping[str, Tensor] | None
    tokenizer: Tokenizer | None
    decode_limit: int


def _decode_limit(examples: Sequence[Example], *, text: bool) -> int:
    """How many tokens a seq2seq hypothesis may run to: the split's longest reference plus slack
    (twice it plus 10 for text, 2 for the formal tasks' exact match). One limit for the whole
    split, so that no result depends on the batch size or on which references share a batch."""
    longest = max((len(e.target) for e in examples if e.target is not None), default=0)
    return longest + (longest + 10 if text else 2)


class _Accumulator:
    """Per-token counts and text pairs gathered across batches."""

    def __init__(self) -> None:
        self.token_correct = 0
        self.token_total = 0
        self.exact: list[bool] = []
        self.per_sequence: list[float] = []
        self.hypotheses: list[str] = []
        self.references: list[str] = []

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.token_total:
            out["token_accuracy"] = self.token_correct / self.token_total
        if self.exact:
            out["sequence_accuracy"] = sum(self.exact) / len(self.exact)
            out["token_accuracy_per_sequence"] = sum(self.per_sequence) / len(self.per_sequence)
        if self.hypotheses:
            out["bleu"] = metrics.bleu(self.hypotheses, self.references)
        return out


def _score_seq2seq(model: nn.Module, batch: Batch, context: _Context, acc: _Accumulator) -> list[bool] | list[float]:
    task, tokenizer = context.task, context.tokenizer
    references = [row[mask].tolist() for row, mask in zip(batch.tgt_out, batch.tgt_is_token)]
    references = [r[:-1] for r in references]  # drop EOS
    hypotheses = decode(
        model,
        batch.src,
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        pad_id=task.pad_id,
        options=DecodeOptions(max_length=context.decode_limit),
        head_mask=context.head_mask,
        positions=planned_positions(model, batch.tgt_in, task.pad_id),  # None unless randomized
    )
    predictions = [h.tokens for h in hypotheses]
    for p, r in zip(predictions, references):
        acc.token_correct += sum(1 for i, t in enumerate(r) if i < len(p) and p[i] == t)
        acc.token_total += len(r)
    if tokenizer is not None:
        target = getattr(task, "target", tokenizer)
        acc.hypotheses.extend(target.decode(p) for p in predictions)
        acc.references.extend(target.decode(r) for r in references)
    exact = [p == r for p, r in zip(predictions, references)]
    acc.exact.extend(exact)
    fractions = _per_sequence(task, hypotheses, references)
    acc.per_sequence.extend(fractions)
    return fractions if getattr(task, "headline_metric", None) == "token_accuracy_per_sequence" else exact


def _per_sequence(task: Any, hypotheses: Sequence[Any], references: list[list[int]]) -> list[float]:
    """Each sequence's share of output tokens right; with the task's ``scores_terminator``, EOS
    ends both the reference and a finished hypothesis and is scored like any token."""
    if not getattr(task, "scores_terminator", False):
        return metrics.token_accuracy_per_sequence([h.tokens for h in hypotheses], references)
    ended = [h.tokens + [task.eos_id] if h.finished else h.tokens for h in hypotheses]
    return metrics.token_accuracy_per_sequence(ended, [r + [task.eos_id] for r in references])


def _score_classifier(model: nn.Module, batch: Batch, context: _Context, acc: _Accumulator) -> list[bool]:
    with masking_heads(model, context.head_mask):
        predicted = model(batch.src).argmax(-1)
    return (predicted == batch.labels).tolist()


def _score_lm(model: nn.Module, batch: Batch, context: _Context, acc: _Accumulator) -> list[bool]:
    if batch.next_symbols is not None:
        return _score_next_symbols(model, batch, context, acc)
    with masking_heads(model, context.head_mask):
        predicted = model(batch.tgt_in).argmax(-1)
    hits = (predicted == batch.tgt_out) & batch.tgt_is_token
    acc.token_correct += int(hits.sum())
    acc.token_total += int(batch.tgt_is_token.sum())
    return (hits | ~batch.tgt_is_token).all(1).tolist()


def next_symbol_hits(logits: Tensor, next_symbols: Tensor, is_token: Tensor) -> Tensor:
    """Which positions predict their whole next-symbol set: sigmoid(z) > 0.5 (z > 0) for exactly
    the symbols that may follow (Bhattamishra et al. 2020); padding counts as a hit.

    Shape:
        logits: (B, T, V);  next_symbols, is_token: (B, T);  returns (B, T) bool.
    """
    predicted = logits[..., FIRST_PREDICTED_ID:] > 0
    wanted = next_symbol_targets(next_symbols, logits.shape[-1])
    return (predicted == wanted).all(-1) | ~is_token


def _score_next_symbols(model: nn.Module, batch: Batch, context: _Context, acc: _Accumulator) -> list[bool]:
    """A string is right when every position's set is right; token_accuracy counts positions."""
    with masking_heads(model, context.head_mask):
        logits = model(batch.tgt_in)
    hits = next_symbol_hits(logits, batch.next_symbols, batch.tgt_is_token)
    acc.token_correct += int((hits & batch.tgt_is_token).sum())
    acc.token_total += int(batch.tgt_is_token.sum())
    return hits.all(1).tolist()


_SCORERS = {
    "encoder_decoder": _score_seq2seq,
    "encoder_classifier": _score_classifier,
    "decoder_only": _score_lm,
}
