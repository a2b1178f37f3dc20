"""Did the model learn at all? Whether it fit its training split, beside every evaluation.

A low test or length-generalisation accuracy means two different things: the model learned its
training data and did not generalise, or it never learned it (hard attention on parity stays near
chance even on the strings it trained on: Hahn 2020). Every evaluation at the end of training and
every ``attnlab eval`` therefore reports

    trained = (accuracy on the training split >= TRAINED_THRESHOLD),

with ``train_accuracy`` and the threshold beside it. The accuracy is the task's headline one
(:func:`attnlab.evaluation.evaluate`: recognition accuracy for a classifier, exact-match sequence
accuracy for seq2seq, all-tokens-right for a language model), measured with the heads the run
holds off, on at most :data:`FIT_EXAMPLES` training examples spread evenly over the split (all of
them when the split is that small). The threshold, 0.9, sits far above chance for every formal task
(0.5 for a balanced recognition task, less for sequences) and below the 1.0 that label noise or a
few over-long strings would make unreachable. For a text task, where fitting every token is not the
aim, ``trained`` says whether the model memorised its training text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.evaluation.evaluate import evaluate
from attnlab.tasks.base import Example
from attnlab.tokenizers import Tokenizer

__all__ = ["TRAINED_THRESHOLD", "FIT_EXAMPLES", "training_fit", "fit_sample"]

TRAINED_THRESHOLD = 0.9
"""Training-split accuracy at or above which a model counts as having fit (learned) its task."""

FIT_EXAMPLES = 2000
"""The most training examples the fit is measured on (spread evenly over the split)."""


def fit_sample(examples: Sequence[Example], limit: int = FIT_EXAMPLES) -> list[Example]:
    """At most ``limit`` examples spread evenly over ``examples``: those at indices
    floor(i n / k) for i = 0..k-1 (k = min(n, limit)); all of them when n <= limit."""
    n = len(examples)
    k = min(n, limit)
    return [examples[i * n // k] for i in range(k)]


class _TrainSample:
    """A task whose ``train`` split is a sample of another task's; everything else is the task's."""

    def __init__(self, task: Any, examples: list[Example]) -> None:
        self._task, self._examples = task, examples

    def split(self, name: str) -> list[Example]:
        return self._examples if name == "train" else self._task.split(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._task, name)


@torch.no_grad()
def training_fit(
    model: nn.Module,
    task: Any,
    *,
    kind: str,
    batch_size: int = 128,
    max_length: int | None = None,
    truncate: bool = False,
    tokenizer: Tokenizer | None = None,
    head_mask: Mapping[str, Tensor] | None = None,
    device: torch.device | str | None = None,
    limit: int = FIT_EXAMPLES,
    positions_seed: int | None = None,
) -> dict[str, Any]:
    """Whether ``model`` fit the training split of ``task`` (see the module docstring).

    Args:
        kind, batch_size, max_length, truncate, tokenizer, head_mask, device, positions_seed: as
            for :func:`attnlab.evaluation.evaluate`.
        limit: the most training examples to measure on.

    Returns:
        ``{"trained": bool | None, "train_accuracy": float | None, "train_examples": int,
        "trained_threshold": TRAINED_THRESHOLD}``; ``trained`` and ``train_accuracy`` are None when
        the task has no training examples (a pretrained model's task).
    """
    sample = fit_sample(task.split("train"), limit)
    report: dict[str, Any] = {
        "trained": None,
        "train_accuracy": None,
        "train_examples": len(sample),
        "trained_threshold": TRAINED_THRESHOLD,
    }
    if not sample:
        return report
    result = evaluate(
        model,
        _TrainSample(task, sample),
        "train",
        kind=kind,
        batch_size=batch_size,
        max_length=max_length,
        truncate=truncate,
        tokenizer=tokenizer,
        head_mask=head_mask,
        device=device,
        positions_seed=positions_seed,
    )
    accuracy = float(result["accuracy"])
    report.update(trained=accuracy >= TRAINED_THRESHOLD, train_accuracy=accuracy)
    return report
