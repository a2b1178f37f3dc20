"""Head probes for a sentence encoder: embedding fidelity (no labels) and scored sentence pairs.

Michel et al. measure a head by what masking it (xi_h = 0 in MHAtt(x, q) = sum_h xi_h Att_h(x, q),
§2.3) does to a task. A pretrained sentence encoder has no task of its own, so two objectives:

**Fidelity** (:class:`FidelityProbe`, label-free). For each text x of a file, r(x) is the sentence
embedding of the unmasked model (its held heads, ``train.mask_heads``, off: the base mask b of
:mod:`attnlab.analysis.heads`) and e_xi(x) the one under head mask xi. Per example,

    loss(x) = 1 - cos(e_xi(x), r(x)),        metric (fidelity) = E_x cos(e_xi(x), r(x)),

so the unmasked model has fidelity 1. Importance needs one more step. Michel's score
I_h = E_x |dL(x)/dxi_h| is a first-order estimate, but at xi = 1 the fidelity is at its maximum,
so dL/dxi_h = 0 exactly for every head: the first-order term carries no information. The change
is second order: with J_h = de/dxi_h and P the projection orthogonal to r,

    1 - cos(r - J_h, r) ~= |P J_h|^2 / (2 |r|^2).

The probe therefore adds to each example's loss a term whose *value* is zero and whose gradient
is u . J_h, with u = P z / |r| and z ~ N(0, I) drawn once per example from a seeded generator:
E_z (u . J_h)^2 = |P J_h|^2 / |r|^2, twice the predicted fidelity loss of removing head h. So
E_x |dL/dxi_h| ranks heads by (the square root of) that predicted loss, still from one forward and
one backward pass per batch, for all heads at once (see :func:`attnlab.analysis.heads.importance`).
Away from xi = 1 (``--recompute``) the ordinary gradient of 1 - cos adds to it.

**Pairs** (:class:`PairProbe`, labelled). A UTF-8 TSV file, ``sentence1<TAB>sentence2<TAB>score``
per line (e.g. STS-B, scores 0..5). With s' the score rescaled to [0, 1] by the file's smallest and
largest score, per pair

    loss = (cos(e(a), e(b)) - s')^2,         metric = Spearman correlation of cos(e(a), e(b)) with s,

the usual STS evaluation (Spearman is invariant to the rescaling; the squared error is the
CosineSimilarityLoss that sentence-transformers trains such models with).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.analysis.heads import Score
from attnlab.errors import DataError
from attnlab.nn import HeadMask
from attnlab.run.loaded import LoadedRun
from attnlab.sentence_embedding import check_encoder_run, pad_ids, sentence_embeddings
from attnlab.tasks.text import read_lines

__all__ = [
    "FidelityBatch",
    "FidelityLoss",
    "FidelityProbe",
    "PairBatch",
    "PairProbe",
    "read_pairs",
    "spearman",
    "average_ranks",
]


# ---- fidelity -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FidelityBatch:
    """Texts as ids and what the unmasked model made of them.

    Shape:
        tokens: (B, T);  reference: (B, d) unmasked embeddings r(x);  projection: (B, d) the u of
        the module docstring, orthogonal to r(x).
    """

    tokens: Tensor
    reference: Tensor
    projection: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


def _length_sorted_chunks(rows: Sequence[Sequence[int]], batch_size: int) -> list[list[int]]:
    order = sorted(range(len(rows)), key=lambda i: (len(rows[i]), i))  # little padding, fixed order
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise DataError(f"batch_size: must be >= 1, got {batch_size}")


class _EncoderProbe:
    """What the encoder's objectives share: the run, its pad id, pooling and device, and the base
    mask (by default the run's held heads, ``loaded.held_mask()``)."""

    def __init__(self, loaded: LoadedRun, what: str, base_mask: HeadMask | None = None) -> None:
        check_encoder_run(loaded, what)
        self.loaded = loaded
        self.base_mask: HeadMask | None = loaded.held_mask() if base_mask is None else base_mask
        self.model: nn.Module = loaded.model.eval()
        self.pad_id: int = loaded.task.pad_id
        self.pooling: str = loaded.task.pooling
        self.device = next(self.model.parameters()).device

    def _embed(self, model: nn.Module, tokens: Tensor, head_mask: Mapping[str, Tensor] | None) -> Tensor:
        return sentence_embeddings(model, tokens, pad_id=self.pad_id, pooling=self.pooling, head_mask=head_mask)


class FidelityLoss(_EncoderProbe):
    """Embedding fidelity to the unmasked model, text by text and batch by batch (see the module
    docstring); it holds no texts. :class:`FidelityProbe` adds a file's texts, read into memory;
    :mod:`attnlab.analysis.corpus` streams a file of any size through the same methods
    (:mod:`attnlab.analysis.corpus_sums`'s importance and ablation sums).

    Each text's projection u is drawn from a generator seeded from ``seed`` and the text's ids, so
    a text gets the same u in any batch and on any process.

    Args:
        loaded: a sentence encoder run.
        seed: seeds the projections u (so importances are reproducible).
        base_mask: the reference model's head mask; default the run's held heads.

    Raises:
        UsageError: the run is not a sentence encoder's.
    """

    metric_name = "embedding fidelity (mean cosine similarity)"
    denominator = "texts"
    """The sum a mean loss divides by: every text weighs alike."""

    def __init__(self, loaded: LoadedRun, *, seed: int = 0, base_mask: HeadMask | None = None) -> None:
        super().__init__(loaded, "--texts (embedding fidelity)", base_mask)
        self.seed = seed

    def encode(self, text: str, *, where: str) -> list[int]:  # noqa: ARG002 (every text has ids)
        """``text`` as the encoder reads it (``where``, ``FILE:LINE``, as for the other objectives)."""
        return self.loaded.codec.encode(text)

    @torch.no_grad()
    def batch(self, rows: Sequence[Sequence[int]]) -> FidelityBatch:
        """``rows`` padded, with the unmasked embeddings r(x) and each text's projection u."""
        tokens = pad_ids(rows, pad_id=self.pad_id).to(self.device)
        reference = self._embed(self.model, tokens, self.base_mask)
        z = torch.stack([self._normal(row, reference.shape[-1]) for row in rows]).to(reference)
        unit = F.normalize(reference, dim=-1)
        orthogonal = z - (z * unit).sum(-1, keepdim=True) * unit  # P z
        projection = orthogonal / reference.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return FidelityBatch(tokens, reference, projection)

    def _normal(self, row: Sequence[int], width: int) -> Tensor:
        """z ~ N(0, I) of the text ``row``, from a generator seeded from the seed and its ids."""
        digest = hashlib.sha256(f"{self.seed}:{list(row)}".encode()).digest()
        return torch.randn(width, generator=torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1))

    def counts(self, rows: Sequence[Sequence[int]], batch: FidelityBatch) -> dict[str, Tensor]:  # noqa: ARG002
        """The batch's count: texts."""
        return {"texts": torch.tensor(float(len(rows)), dtype=torch.float64)}

    def count_zeros(self) -> dict[str, Tensor]:
        return {"texts": torch.zeros((), dtype=torch.float64)}

    def example_losses(self, batch: FidelityBatch, head_mask: HeadMask | None) -> Tensor:
        """1 - cos(e_xi, r) per text, plus a zero-valued term whose gradient is u . de/dxi (see above)."""
        embedding = self._embed(self.model, batch.tokens, head_mask)
        loss = 1.0 - F.cosine_similarity(embedding, batch.reference, dim=-1)
        second_order = (batch.projection * (embedding - embedding.detach())).sum(-1)  # value 0, gradient u . J
        return loss + second_order

    @torch.no_grad()
    def loss_sum(self, batch: FidelityBatch, head_mask: HeadMask | None) -> Tensor:
        """sum_x (1 - cos(e_xi(x), r(x))) over the batch: a float64 scalar on the CPU."""
        embedding = self._embed(self.model, batch.tokens, head_mask)
        return (1.0 - F.cosine_similarity(embedding, batch.reference, dim=-1)).double().sum().cpu()

    @staticmethod
    def score(loss_sum: float, texts: float) -> Score:
        """Fidelity 1 - loss_sum / texts (the mean cosine) and the mean loss."""
        return Score(1.0 - loss_sum / texts, loss_sum / texts)

    def settings(self) -> dict[str, object]:
        """What changes a corpus run's sums besides the file and the run (its resume identity)."""
        return {"seed": self.seed}

    def outputs(self, model: nn.Module, batch: FidelityBatch, head_mask: HeadMask | None) -> Tensor:
        """The sentence embeddings of ``model`` (e.g. a physically pruned one) on ``batch``."""
        return self._embed(model, batch.tokens, head_mask)


class FidelityProbe(FidelityLoss):
    """Embedding fidelity to the unmasked model over the texts of a file, held in memory (see the
    module docstring); a head probe (:class:`attnlab.analysis.heads.HeadProbe`).

    Args:
        loaded: a sentence encoder run.
        texts_file: plain text, one text per non-empty line.
        batch_size: texts per batch.
        seed: seeds the projections u (so importances are reproducible).
        base_mask: the reference model's head mask; default the run's held heads.
    """

    def __init__(
        self,
        loaded: LoadedRun,
        texts_file: str | os.PathLike[str],
        *,
        batch_size: int = 32,
        seed: int = 0,
        base_mask: HeadMask | None = None,
    ) -> None:
        super().__init__(loaded, seed=seed, base_mask=base_mask)
        _check_batch_size(batch_size)
        self.batch_size = batch_size
        lines = read_lines(texts_file)
        rows = [self.encode(text, where=f"{texts_file}:{n}") for n, text in zip(lines.numbers, lines.items)]
        self._batches = [self.batch([rows[i] for i in chunk]) for chunk in _length_sorted_chunks(rows, batch_size)]
        self.texts = len(rows)

    def batches(self) -> Iterator[FidelityBatch]:
        return iter(self._batches)

    @torch.no_grad()
    def evaluate(self, head_mask: HeadMask | None) -> Score:
        return self.score(float(sum(self.loss_sum(batch, head_mask) for batch in self._batches)), self.texts)


# ---- pairs ----------------------------------------------------------------------------------------


def read_pairs(path: str | os.PathLike[str]) -> tuple[list[tuple[str, str]], list[float]]:
    """(sentence1, sentence2) pairs and their scores from a ``s1<TAB>s2<TAB>score`` file.

    Raises:
        DataError: a line without exactly two tabs, an empty sentence or a score that is not a
        finite number (with the file and line), or a file whose scores are all equal.
    """
    lines = read_lines(path)
    pairs, scores = [], []
    for number, line in zip(lines.numbers, lines.items, strict=True):
        parts = line.split("\t")
        if len(parts) != 3:
            raise DataError(f"{path}:{number}: expected 'sentence1<TAB>sentence2<TAB>score', got {len(parts) - 1} tabs")
        first, second, raw = parts
        if not first.strip() or not second.strip():
            raise DataError(f"{path}:{number}: empty sentence")
        try:
            score = float(raw)
        except ValueError:
            raise DataError(f"{path}:{number}: score {raw.strip()!r} is not a number") from None
        if not np.isfinite(score):
            raise DataError(f"{path}:{number}: score {raw.strip()!r} is not finite")
        pairs.append((first, second))
        scores.append(score)
    if len(set(scores)) < 2:
        raise DataError(f"{path}: every pair has the same score; a correlation needs different scores")
    return pairs, scores


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, ties sharing the average of their ranks."""
    x = np.asarray(values, dtype=float)
    sorter = np.argsort(x, kind="mergesort")
    inverse = np.empty_like(sorter)
    inverse[sorter] = np.arange(len(x))
    ordered = x[sorter]
    starts = np.r_[True, ordered[1:] != ordered[:-1]]
    dense = starts.cumsum()[inverse]  # 1-based group of each value
    bounds = np.r_[np.nonzero(starts)[0], len(x)]
    return 0.5 * (bounds[dense] + bounds[dense - 1] + 1)


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation: Pearson's correlation of the average ranks."""
    ra, rb = average_ranks(a), average_ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum() / denominator) if denominator > 0 else 0.0


@dataclass(frozen=True)
class PairBatch:
    """B pairs: both sides padded to one width and stacked, first sides first.

    Shape:
        tokens: (2B, T);  target: (B,) scores rescaled to [0, 1];  score: (B,) as in the file.
    """

    tokens: Tensor
    target: Tensor
    score: Tensor

    def __len__(self) -> int:
        return self.target.shape[0]


def _twice(head_mask: HeadMask | None) -> HeadMask | None:
    """A per-example mask (B, layers, heads) repeated for the 2B stacked sentences."""
    if head_mask is None:
        return None
    return {kind: torch.cat([mask, mask]) if mask.dim() == 3 else mask for kind, mask in head_mask.items()}


class PairProbe(_EncoderProbe):
    """Scored sentence pairs (see the module docstring): metric = Spearman correlation."""

    metric_name = "Spearman correlation with the pair scores"

    def __init__(
        self,
        loaded: LoadedRun,
        pairs_file: str | os.PathLike[str],
        *,
        batch_size: int = 32,
        base_mask: HeadMask | None = None,
    ) -> None:
        super().__init__(loaded, "--pairs (scored sentence pairs)", base_mask)
        _check_batch_size(batch_size)
        self.batch_size = batch_size
        pairs, scores = read_pairs(pairs_file)
        low, high = min(scores), max(scores)
        rows = [(loaded.codec.encode(a), loaded.codec.encode(b)) for a, b in pairs]
        self._batches: list[PairBatch] = []
        for chunk in _length_sorted_chunks([a + b for a, b in rows], batch_size):
            tokens = pad_ids([rows[i][0] for i in chunk] + [rows[i][1] for i in chunk], pad_id=self.pad_id)
            score = torch.tensor([scores[i] for i in chunk], dtype=torch.float32)
            self._batches.append(
                PairBatch(tokens.to(self.device), ((score - low) / (high - low)).to(self.device), score)
            )
        self.pairs = len(rows)

    def batches(self) -> Iterator[PairBatch]:
        return iter(self._batches)

    def _cosines(self, batch: PairBatch, head_mask: HeadMask | None) -> Tensor:
        embedding = self._embed(self.model, batch.tokens, _twice(head_mask))
        first, second = embedding.split(len(batch))
        return F.cosine_similarity(first, second, dim=-1)

    def example_losses(self, batch: PairBatch, head_mask: HeadMask | None) -> Tensor:
        return (self._cosines(batch, head_mask) - batch.target) ** 2

    @torch.no_grad()
    def evaluate(self, head_mask: HeadMask | None) -> Score:
        cosines = torch.cat([self._cosines(b, head_mask) for b in self._batches])
        scores = torch.cat([b.score for b in self._batches])
        targets = torch.cat([b.target for b in self._batches])
        loss = float(((cosines - targets.to(cosines)) ** 2).mean())
        return Score(spearman(cosines.cpu().tolist(), scores.tolist()), loss)

    def outputs(self, model: nn.Module, batch: PairBatch, head_mask: HeadMask | None) -> Tensor:
        return self._embed(model, batch.tokens, _twice(head_mask))
