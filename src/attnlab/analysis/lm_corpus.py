"""A language model's next-token loss over a corpus: perplexity, head importance and ablation as
corpus runs (:mod:`attnlab.analysis.corpus`: streamed, on several processes, resumable).

Each is a :class:`~attnlab.analysis.corpus.CorpusObjective` over the texts of a file, each text
encoded as :class:`~attnlab.analysis.lm_probe.NextTokenLoss` encodes it, with these float64 sums
(besides ``texts``, ``tokens`` = sum_x (n_x - 1) and ``truncated``):

* :class:`PerplexitySums`: ``nll`` = sum_x sum_t -log p(x_t | x_{<t}) under the base mask; the
  perplexity is exp(nll / tokens) (``attnlab eval --texts``).
* :class:`ImportanceSums`: per attention kind, sum_x |dL(x)/dxi_h| at xi = 1 (Michel et al. 2019,
  :func:`attnlab.analysis.heads.importance_sums`); I_h is the sum over ``texts``.
* :class:`AblationSums`: ``nll`` under each mask of :func:`attnlab.analysis.heads.ablation_plan`
  (``ablated``, one entry per row) and under the base mask; each row's perplexity as above.

Each gives the result of the in-memory analysis it matches (:class:`NextTokenProbe`'s
``evaluate``, :func:`~attnlab.analysis.heads.importance`, :func:`~attnlab.analysis.heads.ablate`)
to float noise: only the batches differ.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from attnlab.analysis.heads import (
    Ablation,
    HeadId,
    ImportanceRow,
    ablation_of,
    ablation_plan,
    importance_point,
    importance_rows,
    importance_sums,
    importance_zeros,
    removal,
)
from attnlab.analysis.lm_probe import NextTokenLoss, ScoredText, predicted_tokens
from attnlab.errors import DataError
from attnlab.nn import HeadMask

__all__ = ["PerplexitySums", "ImportanceSums", "AblationSums", "text_counts"]


def _zero() -> Tensor:
    return torch.zeros((), dtype=torch.float64)


def _counts(texts: Sequence[ScoredText], tokens: int) -> dict[str, Tensor]:
    return {
        "texts": torch.tensor(float(len(texts)), dtype=torch.float64),
        "tokens": torch.tensor(float(tokens), dtype=torch.float64),
        "truncated": torch.tensor(float(sum(text.truncated for text in texts)), dtype=torch.float64),
    }


def text_counts(sums: Mapping[str, Tensor], path: str | os.PathLike[str]) -> dict[str, int]:
    """The counts of a run's sums over the file ``path``, as integers: texts, tokens, skipped and
    truncated texts.

    Raises:
        DataError: no text of the file had two tokens or more (nothing was predicted).
    """
    counts = {name: int(sums[name]) for name in ("texts", "tokens", "skipped", "truncated")}
    if counts["texts"] == 0:
        raise DataError(f"{os.fspath(path)}: no text of two tokens or more, so no next token to predict")
    return counts


class _TextSums:
    """What the three objectives share: the loss, how a line is encoded, the counts."""

    def __init__(self, loss: NextTokenLoss) -> None:
        self.loss = loss

    def zeros(self) -> dict[str, Tensor]:
        return {"texts": _zero(), "tokens": _zero(), "truncated": _zero()}

    def encode(self, text: str, *, where: str) -> ScoredText | None:
        return self.loss.encode(text, where=where)


class PerplexitySums(_TextSums):
    """The summed next-token loss under ``head_mask`` (default: the loss's base mask)."""

    def __init__(self, loss: NextTokenLoss, head_mask: HeadMask | None = None) -> None:
        super().__init__(loss)
        self.head_mask = loss.base_mask if head_mask is None else head_mask

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), "nll": _zero()}

    def measure(self, texts: Sequence[ScoredText]) -> dict[str, Tensor]:
        batch = self.loss.batch(texts)
        return {**_counts(texts, predicted_tokens(batch)), "nll": self.loss.loss_sum(batch, self.head_mask)}


class ImportanceSums(_TextSums):
    """sum_x |dL(x)/dxi_h| per attention kind at the loss's base mask (one forward and backward)."""

    def __init__(self, loss: NextTokenLoss) -> None:
        super().__init__(loss)
        self.point = importance_point(loss)

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), **importance_zeros(self.loss.model)}

    def measure(self, texts: Sequence[ScoredText]) -> dict[str, Tensor]:
        batch = self.loss.batch(texts)
        return {**_counts(texts, predicted_tokens(batch)), **importance_sums(self.loss, batch, self.point)}

    def rows(
        self, sums: Mapping[str, Tensor], *, normalize_per_layer: bool = False, kinds: Sequence[str] | None = None
    ) -> list[ImportanceRow]:
        """I_h = the mean over texts, as :func:`attnlab.analysis.heads.importance` reports it."""
        return importance_rows(
            self.loss.model, sums, float(sums["texts"]), normalize_per_layer=normalize_per_layer, kinds=kinds
        )


class AblationSums(_TextSums):
    """The summed next-token loss under the base mask and under each ablation of
    :func:`attnlab.analysis.heads.ablation_plan` (with ``means``, mean ablation)."""

    def __init__(
        self, loss: NextTokenLoss, kinds: Sequence[str] | None = None, means: Mapping[str, Tensor] | None = None
    ) -> None:
        super().__init__(loss)
        self.plan: list[tuple[HeadId, list[HeadId]]] = ablation_plan(loss, kinds)
        self.means = means
        for _, off in self.plan:  # a head without a mean is refused before any batch
            removal(loss, off, means)

    def zeros(self) -> dict[str, Tensor]:
        return {**super().zeros(), "nll": _zero(), "ablated": torch.zeros(len(self.plan), dtype=torch.float64)}

    def measure(self, texts: Sequence[ScoredText]) -> dict[str, Tensor]:
        batch = self.loss.batch(texts)
        baseline = self.loss.loss_sum(batch, self.loss.base_mask)
        ablated = torch.zeros(len(self.plan), dtype=torch.float64)
        for index, (_, off) in enumerate(self.plan):
            if not off:
                ablated[index] = baseline
                continue
            mask, edit = removal(self.loss, off, self.means)
            with edit:
                ablated[index] = self.loss.loss_sum(batch, mask)
        return {**_counts(texts, predicted_tokens(batch)), "nll": baseline, "ablated": ablated}

    def ablation(self, sums: Mapping[str, Tensor]) -> Ablation:
        """The :class:`~attnlab.analysis.heads.Ablation` the sums give (perplexities per row)."""
        tokens = float(sums["tokens"])
        baseline = self.loss.score(float(sums["nll"]), tokens)
        scores = [self.loss.score(float(value), tokens) for value in sums["ablated"]]
        return ablation_of(self.plan, baseline, scores)
