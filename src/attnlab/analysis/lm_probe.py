"""The head probe of a language model: next-token loss over the texts of a file.

Michel et al. score head h by what masking it (xi_h = 0 in MHAtt(x, q) = sum_h xi_h Att_h(x, q),
§2.3) does to the model's loss. For a causal language model the loss of a text x = x_1 .. x_n is
the mean next-token negative log-likelihood over its real tokens,

    L(x) = -1/(n-1) sum_{t=2..n} log p(x_t | x_{<t}),

and the metric is the corpus perplexity exp(sum_x sum_t -log p / sum_x (n_x - 1)), every predicted
token weighted alike (what ``attnlab eval --texts`` reports; lower is better). Importance is
Michel's I_h = E_x |dL(x)/dxi_h|, the mean over texts, from one forward and one backward pass per
batch (:func:`attnlab.analysis.heads.importance`).

Choices: each line of the file is one text, encoded by the run's task as the model reads it
(``task.scored_ids``). A pretrained LM's (:class:`attnlab.tasks.pretrained_lm.PretrainedLMTask`)
has a BOS in front when the model adds one, so the first word is predicted too (SmolLM2 adds none,
so its first token is context only), and no EOS: a line of a file is not a finished document, and
a chat model's EOS (SmolLM2's ``<|im_end|>``) ends a chat turn. A language model trained here on
lines of text (:class:`attnlab.tasks.text.LMTask`) reads ``BOS text EOS``, as it was trained: the
perplexity of a file is then what ``attnlab eval --split`` reports on a split of the same lines.
A text of a single token predicts nothing and is skipped (counted in
:attr:`NextTokenProbe.skipped`). A text longer than the context is an error naming its line, or
cut to the context with ``truncate`` (counted in :attr:`NextTokenProbe.truncated`).

Padding is never recognised by its id (a pretrained LM's pad id may be a real token, as SmolLM2's
is): texts are padded on the right and the model is given which positions are real
(``DecoderOnly.forward(is_token=...)``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.analysis.heads import Score
from attnlab.devices import model_device
from attnlab.errors import DataError, UsageError
from attnlab.nn import HeadMask, masking_heads
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.pretrained_lm import PretrainedLMTask
from attnlab.tasks.text import MAX_LINE_CHARS, LMTask, read_lines

__all__ = [
    "TextBatch",
    "ScoredText",
    "NextTokenLoss",
    "NextTokenProbe",
    "check_language_model_run",
    "pad_right",
    "predicted_tokens",
]


@dataclass(frozen=True)
class TextBatch:
    """Texts as ids, padded on the right, and which positions are real tokens.

    Shape:
        tokens: (B, T);  is_token: (B, T) bool, True at real tokens (a prefix of each row).
    """

    tokens: Tensor
    is_token: Tensor

    def __len__(self) -> int:
        return self.tokens.shape[0]


def pad_right(rows: Sequence[Sequence[int]], pad_id: int) -> TextBatch:
    """Rows of ids padded with ``pad_id`` on the right, and their real positions."""
    width = max(len(row) for row in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    is_token = torch.zeros(len(rows), width, dtype=torch.bool)
    for index, row in enumerate(rows):
        tokens[index, : len(row)] = torch.tensor(row, dtype=torch.long)
        is_token[index, : len(row)] = True
    return TextBatch(tokens, is_token)


def check_language_model_run(loaded: LoadedRun, what: str) -> None:
    """Refuse a run that is not a causal language model of text (task ``lm`` or ``pretrained_lm``)."""
    if not isinstance(loaded.task, (PretrainedLMTask, LMTask)):
        raise UsageError(
            f"{what} needs a language model run of text (task lm, or pretrained_lm from attnlab import gguf); "
            f"{loaded.source} is a {loaded.experiment.model_kind} run of task {loaded.experiment.task_name!r}"
        )


def _next_token_nll(logits: Tensor, batch: TextBatch) -> tuple[Tensor, Tensor]:
    """-log p(x_t | x_{<t}) at every position t >= 2 and whether it is predicted: x_t and x_{t-1}
    are both real tokens (padding on either side). The targets are shifted, not the logits, so the
    (B, T, V) logits are read in place (no copy of the largest tensor of the pass).

    Shape:
        logits: (B, T, V);  returns (B, T-1) float (0 where not predicted) and (B, T-1) bool.
    """
    rows, width, vocabulary = logits.shape
    real = batch.is_token[:, 1:] & batch.is_token[:, :-1]
    targets = F.pad(
        batch.tokens[:, 1:].masked_fill(~real, -100), (0, 1), value=-100
    )  # (B, T); the last predicts nothing
    nll = F.cross_entropy(logits.reshape(rows * width, vocabulary), targets.reshape(-1), reduction="none")
    return nll.view(rows, width)[:, :-1], real


@dataclass(frozen=True)
class ScoredText:
    """One text as the model reads it: its ids, and whether they were cut to the context."""

    ids: list[int]
    truncated: bool = False

    def __len__(self) -> int:
        return len(self.ids)


class NextTokenLoss:
    """The next-token loss of a language model, text by text and batch by batch (see the module
    docstring); it holds no texts. :class:`NextTokenProbe` adds a file's texts, read into memory;
    :mod:`attnlab.analysis.corpus` streams a file of any size through the same methods.

    Args:
        loaded: a language model run of text (task ``lm`` or ``pretrained_lm``).
        truncate: cut a text longer than the context instead of refusing it.
        base_mask: the mask every analysis starts from; default the run's held heads.

    Raises:
        UsageError: the run is not a language model's.
    """

    metric_name = "perplexity (lower is better)"
    denominator = "tokens"
    """The sum a mean loss divides by: every predicted token weighs alike."""

    def __init__(self, loaded: LoadedRun, *, truncate: bool = False, base_mask: HeadMask | None = None) -> None:
        check_language_model_run(loaded, "--texts (next-token loss)")
        self.loaded, self.truncate = loaded, truncate
        self.model: nn.Module = loaded.model.eval()
        self.base_mask: HeadMask | None = loaded.held_mask() if base_mask is None else base_mask
        task_context = loaded.task.scored_context
        self.context = (
            loaded.model.config.max_len if task_context is None else min(task_context, loaded.model.config.max_len)
        )

    def encode(self, text: str, *, where: str) -> ScoredText | None:
        """``text`` as ids (cut to the context with ``truncate``); None for a text of one token,
        which predicts nothing. ``where`` (``FILE:LINE``) names the text in an error.

        Raises:
            DataError: the text is longer than the context and ``truncate`` is off.
        """
        ids = self.loaded.task.scored_ids(text)
        truncated = len(ids) > self.context
        if truncated:
            if not self.truncate:
                raise DataError(
                    f"{where}: the text has {len(ids)} tokens, more than the model's context "
                    f"of {self.context}; shorten it, or opt in to truncation (attnlab eval --truncate)"
                )
            ids = ids[: self.context]
        return ScoredText(ids, truncated) if len(ids) >= 2 else None

    def batch(self, texts: Sequence[ScoredText]) -> TextBatch:
        """``texts`` padded on the right, on the model's device."""
        return _to(pad_right([text.ids for text in texts], self.loaded.task.pad_id), model_device(self.model))

    def example_losses(self, batch: TextBatch, head_mask: HeadMask | None) -> Tensor:
        """(B,) mean next-token NLL of each text, differentiable in the head mask."""
        nll, real = _next_token_nll(self.outputs_all(self.model, batch, head_mask), batch)
        return nll.sum(1) / real.sum(1)

    @torch.no_grad()
    def loss_sum(self, batch: TextBatch, head_mask: HeadMask | None) -> Tensor:
        """sum_x sum_t -log p(x_t | x_{<t}) over the batch under ``head_mask``: a float64 scalar
        on the CPU (divide by the predicted tokens for the mean, :meth:`score`)."""
        nll, _ = _next_token_nll(self.outputs_all(self.model, batch, head_mask), batch)
        return nll.double().sum().cpu()

    def count_zeros(self) -> dict[str, Tensor]:
        """Zero counts of a corpus run (:mod:`attnlab.analysis.corpus_sums`)."""
        return {name: torch.zeros((), dtype=torch.float64) for name in ("texts", "tokens", "truncated")}

    def counts(self, texts: Sequence[ScoredText], batch: TextBatch) -> dict[str, Tensor]:
        """The batch's counts: texts, predicted tokens (the mean's denominator), texts cut."""
        values = {"texts": len(texts), "tokens": predicted_tokens(batch), "truncated": sum(t.truncated for t in texts)}
        return {name: torch.tensor(float(value), dtype=torch.float64) for name, value in values.items()}

    def settings(self) -> dict[str, object]:
        """What changes a corpus run's sums besides the file and the run (its resume identity)."""
        return {"truncate": self.truncate}

    @staticmethod
    def score(loss_sum: float, tokens: float) -> Score:
        """Corpus perplexity exp(loss_sum / tokens) and the mean NLL per predicted token."""
        loss = loss_sum / tokens
        return Score(math.exp(min(loss, 700.0)), loss)

    def outputs_all(self, model: nn.Module, batch: TextBatch, head_mask: HeadMask | None) -> Tensor:
        """(B, T, V) logits of ``model`` on ``batch``, padding included."""
        with masking_heads(model, head_mask):
            return model(batch.tokens, is_token=batch.is_token)

    def outputs(self, model: nn.Module, batch: TextBatch, head_mask: HeadMask | None) -> Tensor:
        """(N, V) logits of ``model`` at the batch's N real tokens (e.g. a physically pruned model's)."""
        return self.outputs_all(model, batch, head_mask)[batch.is_token]


def predicted_tokens(batch: TextBatch) -> int:
    """The tokens the batch predicts: each text's length - 1."""
    return int(batch.is_token.sum()) - len(batch)


class NextTokenProbe(NextTokenLoss):
    """Next-token loss of a language model over the texts of a file, held in memory (see the
    module docstring); a head probe (:class:`attnlab.analysis.heads.HeadProbe`).

    Args:
        loaded: a language model run of text (task ``lm`` or ``pretrained_lm``).
        texts_file: plain text, one text per non-empty line; or the texts themselves, a list.
        batch_size: texts per batch (similar lengths together, so little padding).
        max_texts: read only the first this many texts (None: all).
        truncate: cut a text longer than the context instead of refusing it.
        base_mask: the mask every analysis starts from; default the run's held heads.

    Attributes:
        texts: the texts scored;  skipped: single-token texts left out;  truncated: texts cut;
        tokens: the predicted tokens (each text's length - 1), the perplexity's denominator.

    Raises:
        UsageError: the run is not a language model's.
        DataError: a text longer than the context without ``truncate`` (names its line), or no
        text of two tokens or more.
    """

    def __init__(
        self,
        loaded: LoadedRun,
        texts_file: str | os.PathLike[str] | Sequence[str],
        *,
        batch_size: int = 16,
        truncate: bool = False,
        base_mask: HeadMask | None = None,
        max_texts: int | None = None,
    ) -> None:
        super().__init__(loaded, truncate=truncate, base_mask=base_mask)
        if batch_size < 1:
            raise UsageError(f"batch_size: must be >= 1, got {batch_size}")
        if max_texts is not None and max_texts < 1:
            raise UsageError(f"max_texts: must be >= 1, got {max_texts}")
        self.batch_size = batch_size
        if isinstance(texts_file, (str, os.PathLike)):
            lines = read_lines(texts_file, max_line_chars=MAX_LINE_CHARS)
            named = [(f"{texts_file}:{n}", text) for n, text in zip(lines.numbers, lines.items)]
        elif isinstance(texts_file, Sequence) and all(isinstance(text, str) for text in texts_file):
            named = [(f"texts[{n}]", text) for n, text in enumerate(texts_file)]
        else:
            raise UsageError(
                f"texts: a file's path or a list of texts is needed (token ids: NextTokenProbe.of_ids, or "
                f"LanguageModel.importance), got {type(texts_file).__name__}"
            )
        named = named[:max_texts]
        encoded = [self.encode(text, where=where) for where, text in named]
        rows = [text for text in encoded if text is not None]
        if not rows:
            where = texts_file if isinstance(texts_file, (str, os.PathLike)) else "texts"
            raise DataError(f"{where}: no text of two tokens or more, so no next token to predict")
        self.skipped, self.truncated = len(encoded) - len(rows), sum(text.truncated for text in rows)
        self.texts, self.tokens = len(rows), sum(len(text) - 1 for text in rows)
        rows.sort(key=len)  # little padding, a fixed order (the sort is stable)
        self._batches = [self.batch(rows[start : start + batch_size]) for start in range(0, len(rows), batch_size)]

    @classmethod
    def of_ids(
        cls,
        loaded: LoadedRun,
        tokens: Tensor,
        is_token: Tensor | None = None,
        *,
        base_mask: HeadMask | None = None,
    ) -> NextTokenProbe:
        """The probe of one batch of token ids, as the model reads them (no task, no file).

        Args:
            loaded: a language model run of text (task ``lm`` or ``pretrained_lm``).
            tokens: (B, T) ids (a BOS first where the model wants one: ``LanguageModel.tokenize``).
            is_token: (B, T), True (or 1) at real tokens, padding on either side; default all real.
            base_mask: as in the constructor.

        Raises:
            UsageError: the run is not a language model's, ``tokens`` is not a (B, T) integer
            tensor, ``is_token`` has another shape, an id is outside the vocabulary, T exceeds the
            context, or a row has fewer than two real tokens (nothing to predict).
        """
        check_language_model_run(loaded, "importance from token ids (next-token loss)")
        if tokens.dim() != 2 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise UsageError(f"ids: a (B, T) integer tensor is needed, got {tuple(tokens.shape)} {tokens.dtype}")
        if is_token is None:
            is_token = torch.ones_like(tokens, dtype=torch.bool)
        if is_token.shape != tokens.shape:
            raise UsageError(f"is_token: shape {tuple(is_token.shape)} differs from the ids' {tuple(tokens.shape)}")
        is_token = is_token.bool()
        vocabulary = loaded.model.config.vocab_size
        if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= vocabulary):
            raise UsageError(
                f"ids: every id must lie in [0, {vocabulary}), got {int(tokens.min())}..{int(tokens.max())}"
            )
        probe = cls.__new__(cls)
        NextTokenLoss.__init__(probe, loaded, base_mask=base_mask)
        probe.batch_size = len(tokens)
        if tokens.shape[1] > probe.context:
            raise UsageError(f"ids: {tokens.shape[1]} positions, more than the model's context of {probe.context}")
        predicted = (is_token[:, 1:] & is_token[:, :-1]).sum(1)
        if len(tokens) == 0 or bool((predicted == 0).any()):
            raise UsageError("ids: every row needs two real tokens or more (a next token to predict)")
        probe.texts, probe.tokens, probe.skipped, probe.truncated = len(tokens), int(predicted.sum()), 0, 0
        probe._batches = [_to(TextBatch(tokens, is_token), model_device(probe.model))]
        return probe

    def batches(self) -> Iterator[TextBatch]:
        return iter(self._batches)

    def evaluate(self, head_mask: HeadMask | None) -> Score:
        """Corpus perplexity and mean NLL per predicted token under ``head_mask``."""
        return self.score(float(sum(self.loss_sum(batch, head_mask) for batch in self._batches)), self.tokens)


def _to(batch: TextBatch, device: torch.device) -> TextBatch:
    return TextBatch(batch.tokens.to(device), batch.is_token.to(device))
