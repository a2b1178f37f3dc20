"""Evaluate a model on a task split: the metrics of each kind of task, and accuracy per length.

Every result has ``accuracy`` (the task's headline metric: exact-match sequence accuracy for
seq2seq, recognition accuracy, all-tokens-right for language modelling), ``loss`` (teacher-forced
cross-entropy per prediction) and ``accuracy_by_length``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from tqdm import tqdm

from attnlab.decoding import DecodeOptions, decode
from attnlab.tasks.batching import Batch, make_batches
from attnlab.tokenizers import Tokenizer
from attnlab.evaluation import metrics
from attnlab.evaluation.objectives import OBJECTIVES

__all__ = ["evaluate"]


@torch.no_grad()
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
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> dict[str, Any]:
    """Metrics of ``model`` on ``task.split(split)``.

    Args:
        kind: the model kind (``encoder_decoder``, ``encoder_classifier``, ``decoder_only``).
        tokenizer: for text tasks: BLEU is computed on decoded text.
        head_mask: evaluate with these heads masked (Michel §2.3).
    """
    examples = task.split(split)
    if not examples:
        return {"split": split, "examples": 0}
    was_training = model.training
    model.eval()
    batches = make_batches(
        examples, batch_size, pad_id=task.pad_id, bos_id=task.bos_id, eos_id=task.eos_id,
        shuffle=False, bucket=True, max_length=max_length, truncate=truncate,
    )
    totals = {"loss": 0.0, "count": 0}
    correct: list[bool] = []
    lengths: list[int] = []
    extra = _Accumulator()
    objective = OBJECTIVES[kind]
    total_batches = (len(examples) + batch_size - 1) // batch_size
    for batch in tqdm(batches, total=total_batches, desc=f"eval {split}", disable=not progress, leave=False):
        batch = batch.to(device)
        parts = objective(model, batch, head_mask, task.pad_id, 0.0)
        totals["loss"] += float(parts.total)
        totals["count"] += int(parts.count)
        ok = _SCORERS[kind](model, batch, task, head_mask, extra, tokenizer)
        correct.extend(ok)
        lengths.extend(_example_lengths(batch, task))
    model.train(was_training)
    result: dict[str, Any] = {
        "split": split,
        "examples": len(correct),
        "loss": totals["loss"] / max(1, totals["count"]),
        "accuracy": sum(correct) / len(correct),
        "accuracy_by_length": metrics.accuracy_by_length(correct, lengths),
    }
    if kind != "encoder_classifier":
        result["perplexity"] = metrics.perplexity(totals["loss"], totals["count"])
    if kind == "encoder_decoder":
        result["sequence_accuracy"] = result["accuracy"]
    result.update(extra.summary())
    return result


def _example_lengths(batch: Batch, task: Any) -> list[int]:
    """The length that defines the split: symbols before EOS (source), or the target for an LM."""
    if batch.src is not None:
        return (batch.src_is_token.sum(1) - 1).tolist()
    return (batch.tgt_is_token.sum(1) - 1).tolist()


class _Accumulator:
    """Per-token counts and text pairs gathered across batches."""

    def __init__(self) -> None:
        self.token_correct = 0
        self.token_total = 0
        self.hypotheses: list[str] = []
        self.references: list[str] = []

    def summary(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.token_total:
            out["token_accuracy"] = self.token_correct / self.token_total
        if self.hypotheses:
            out["bleu"] = metrics.bleu(self.hypotheses, self.references)
        return out


def _score_seq2seq(model, batch: Batch, task, head_mask, acc: _Accumulator, tokenizer) -> list[bool]:  # noqa: ANN001
    references = [row[mask].tolist() for row, mask in zip(batch.tgt_out, batch.tgt_is_token)]
    references = [r[:-1] for r in references]  # drop EOS
    longest = max(len(r) for r in references)
    slack = longest + 10 if tokenizer is not None else 2
    options = DecodeOptions(max_length=longest + slack)
    hypotheses = decode(
        model, batch.src, bos_id=task.bos_id, eos_id=task.eos_id, pad_id=task.pad_id, options=options, head_mask=head_mask
    )
    predictions = [h.tokens for h in hypotheses]
    for p, r in zip(predictions, references):
        acc.token_correct += sum(1 for i, t in enumerate(r) if i < len(p) and p[i] == t)
        acc.token_total += len(r)
    if tokenizer is not None:
        target = getattr(task, "target", tokenizer)
        acc.hypotheses.extend(target.decode(p) for p in predictions)
        acc.references.extend(target.decode(r) for r in references)
    return [p == r for p, r in zip(predictions, references)]


def _score_classifier(model, batch: Batch, task, head_mask, acc: _Accumulator, tokenizer) -> list[bool]:  # noqa: ANN001
    predicted = model(batch.src, head_mask=head_mask).argmax(-1)
    return (predicted == batch.labels).tolist()


def _score_lm(model, batch: Batch, task, head_mask, acc: _Accumulator, tokenizer) -> list[bool]:  # noqa: ANN001
    predicted = model(batch.tgt_in, head_mask=head_mask).argmax(-1)
    hits = (predicted == batch.tgt_out) & batch.tgt_is_token
    acc.token_correct += int(hits.sum())
    acc.token_total += int(batch.tgt_is_token.sum())
    return (hits | ~batch.tgt_is_token).all(1).tolist()


_SCORERS = {
    "encoder_decoder": _score_seq2seq,
    "encoder_classifier": _score_classifier,
    "decoder_only": _score_lm,
}
