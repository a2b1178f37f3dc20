"""Head analyses as sums over a corpus (:mod:`attnlab.analysis.corpus`: streamed, on several
processes, resumable): a language model's next-token loss (perplexity, importance, ablation) and a
sentence encoder's embedding fidelity (importance, ablation).

Each is a :class:`~attnlab.analysis.corpus.CorpusObjective` over the texts of a file, each text
encoded by its *loss*, a :class:`CorpusLoss`: :class:`~attnlab.analysis.lm_probe.NextTokenLoss`
(with the float64 counts ``texts``, ``tokens`` = sum_x (n_x - 1) and ``truncated``; a mean is per
predicted token) or :class:`~attnlab.analysis.fidelity.FidelityLoss` (``texts``; a mean is per
text). The sums:

* :class:`PerplexitySums` (a language model's): ``nll`` = sum_x sum_t -log p(x_t | x_{<t}) under
  the base mask; the perplexity is exp(nll / tokens) (``attnlab eval --texts``).
* :class:`ImportanceSums`: per attention kind, sum_x |dL(x)/dxi_h| at xi = 1 (Michel et al. 2019,
  :func:`attnlab.analysis.heads.importance_sums`); I_h is the sum over ``texts``.
* :class:`AblationSums`: the summed loss under each mask of
  :func:`attnlab.analysis.heads.ablation_plan` (``ablated``, one entry per row) and under the base
  mask (``loss``); each row's score from them, as the loss scores a mean.

Each gives the result of the in-memory analysis it matches (:class:`NextTokenProbe`'s or
:class:`FidelityProbe`'s ``evaluate``, :func:`~attnlab.analysis.heads.importance`,
:func:`~attnlab.analysis.heads.ablate`) to float noise: only the batches differ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from attnlab.analysis.heads import (
    Ablation,
    HeadId,
    ImportanceRow,
    Score,
    ablation_of,
    ablation_plan,
    importance_point,
    importance_rows,
    importance_sums,
    importance_zeros,
    removal,
)
from attnlab.analysis.lm_probe import NextTokenLoss, ScoredText
from attnlab.errors import DataError
from attnlab.nn import HeadMask

__all__ = ["CorpusLoss", "PerplexitySums", "ImportanceSums", "AblationSums", "text_counts"]


class CorpusLoss(Protocol):
    """A head probe's loss text by text (NextTokenLoss, FidelityLoss): what the sums need of it."""

    model: Any
    base_mask: HeadMask | None
    denominator: str  # the count a mean loss divides by

    def encode(self, text: str, *, where: str) -> Any | None: ...

    def batch(self, items: Sequence[Any]) -> Any: ...

    def count_zeros(self) -> dict[str, Tensor]: ...

    def counts(self, items: Sequence[Any], batch: Any) -> dict[str, Tensor]: ...

    def example_losses(self, batch: Any, head_mask: HeadMask | None) -> Tensor: ...

    def loss_sum(self, batch: Any, head_mask: HeadMask | None) -> Tensor: ...

    def score(self, loss_sum: float, count: float) -> Score: ...

    def settings(self) -> dict[str, object]: ...


def _zero() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


def text_counts(sums: Mapping[str, Tensor], path: str | os.PathLike[str]) -> dict[str, int]:
    """The counts of a run's sums over the file ``path``, as integers: texts, skipped texts and,
    for a language model's, predicted tokens and truncated texts.

    Raises:
        DataError: no text of the file had two tokens or more (nothing was predicted; a sentence
        encoder's non-blank line always has a text to embed).
    """
    counts = {name: int(sums[name]) for name in ("texts", "tokens", "skipped", "truncated") if name in sums}
    if counts["texts"] == 0:
        raise DataError(f"{os.fspath(path)}: no text of two tokens or more, so no next token to predict")
    return counts


class _TextSums:
    """What the objectives share: the loss, how a line is encoded, the counts."""

    def __init__(self, loss: CorpusLoss) -> None:
        self.loss = loss

    def zeros(self) -> dict[str, Tensor]:
        return self.loss.count_zeros()

    def encode(self, text: str, *, where: str) -> Any | None:
        return self.loss.encode(text, where=where)


class PerplexitySums(_TextSums):
    """The summed next-token loss under ``head_mask`` (default: the loss's base mask)."""

    loss: NextTokenLoss

    def __init__(self, loss: NextTokenLoss, head_mask: HeadMask | None = None) -> None:
        super().__init__(loss)
        self.head_mask = loss.base_mask if head_mask is None else head_mask

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), "nll": _zero()}

    def measure(self, texts: Sequence[ScoredText]) -> dict[str, Tensor]:
        batch = self.loss.batch(texts)
        return {**self.loss.counts(texts, batch), "nll": self.loss.loss_sum(batch, self.head_mask)}


class ImportanceSums(_TextSums):
    """sum_x |dL(x)/dxi_h| per attention kind at the loss's base mask (one forward and backward)."""

    def __init__(self, loss: CorpusLoss) -> None:
        super().__init__(loss)
        self.point = importance_point(loss)

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), **importance_zeros(self.loss.model)}

    def measure(self, items: Sequence[Any]) -> dict[str, Tensor]:
        batch = self.loss.batch(items)
        return {**self.loss.counts(items, batch), **importance_sums(self.loss, batch, self.point)}

    def rows(
        self, sums: Mapping[str, Tensor], *, normalize_per_layer: bool = False, kinds: Sequence[str] | None = None
    ) -> list[ImportanceRow]:
        """I_h = the mean over texts, as :func:`attnlab.analysis.heads.importance` reports it."""
        return importance_rows(
            self.loss.model, sums, float(sums["texts"]), normalize_per_layer=normalize_per_layer, kinds=kinds
        )


class AblationSums(_TextSums):
    """The summed loss under the base mask and under each ablation of
    :func:`attnlab.analysis.heads.ablation_plan` (with ``means``, mean ablation)."""

    def __init__(
        self, loss: CorpusLoss, kinds: Sequence[str] | None = None, means: Mapping[str, Tensor] | None = None
    ) -> None:
        super().__init__(loss)
        self.plan: list[tuple[HeadId, list[HeadId]]] = ablation_plan(loss, kinds)
        self.means = means
        for _, off in self.plan:  # a head without a mean is refused before any batch
            removal(loss, off, means)

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), "loss": _zero(), "ablated": torch.zeros(len(self.plan), dtype=torch.float64)}

    def measure(self, items: Sequence[Any]) -> dict[str, Tensor]:
        batch = self.loss.batch(items)
        baseline = self.loss.loss_sum(batch, self.loss.base_mask)
        ablated = torch.zeros(len(self.plan), dtype=torch.float64)
        for index, (_, off) in enumerate(self.plan):
            if not off:
                ablated[index] = baseline
                continue
            mask, edit = removal(self.loss, off, self.means)
            with edit:
                ablated[index] = self.loss.loss_sum(batch, mask)
        return {**self.loss.counts(items, batch), "loss": baseline, "ablated": ablated}

    def ablation(self, sums: Mapping[str, Tensor]) -> Ablation:
        """The :class:`~attnlab.analysis.heads.Ablation` the sums give (a score per row)."""
        count = float(sums[self.loss.denominator])
        baseline = self.loss.score(float(sums["loss"]), count)
        scores = [self.loss.score(float(value), count) for value in sums["ablated"]]
        return ablation_of(self.plan, baseline, scores)
