"""The loss of each model kind: which logits predict which targets.

* encoder_decoder: teacher forcing with the target shifted right (Agarwal §5.2): the decoder reads
  ``tgt_in`` = BOS + y and predicts ``tgt_out`` = y + EOS; padding ignored.
* encoder_classifier: the label read at the EOS position (Hahn §3).
* decoder_only: next-token prediction over ``tgt_in`` -> ``tgt_out``; or, when the batch carries
  ``next_symbols`` (the ``next_char`` formulation of recognition, Bhattamishra, Ahuja & Goyal 2020),
  a multi-label prediction at each position of ``tgt_in``: the output layer's logits of EOS and the
  task symbols (ids >= :data:`FIRST_PREDICTED_ID`) are read as independent sigmoid logits z_{t,c},
  with the binary cross-entropy -[y log s(z) + (1 - y) log(1 - s(z))] against y_{t,c} = 1 iff symbol
  c may follow the prefix read at t (:func:`next_symbol_targets`), summed over the symbols: one
  prediction, and one loss, per position. With ``loss="mse"`` (``train.loss``), the squared error
  (s(z) - y)² of each sigmoid instead, summed over the symbols: Bhattamishra et al.'s objective
  (their code means it over the symbols, a constant factor apart).

Two reductions of the same cross-entropy (with optional label smoothing, Vaswani §5.4):

* :class:`LossParts` (summed loss, number of predictions), so distributed training can divide by
  the *global* count (see :mod:`attnlab.training.distributed`);
* :func:`example_losses`, the mean loss of each example, for head importance
  I_h = E_x |dL(x)/dxi_h| (Michel et al.).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn import masking_heads
from attnlab.tasks.batching import Batch

__all__ = [
    "FIRST_PREDICTED_ID",
    "LossParts",
    "Predictions",
    "PREDICTIONS",
    "OBJECTIVES",
    "SYMBOL_LOSSES",
    "example_losses",
    "next_symbol_targets",
]

FIRST_PREDICTED_ID = 2
"""The first token id a next-symbol set covers: EOS (2), then the task symbols; PAD (0) and BOS (1)
never follow anything (:data:`attnlab.tasks.base.TASK_SPECIALS`)."""


class Predictions(NamedTuple):
    """Logits (B, T, V) or (B, V), the targets they predict (B, T) or (B,), and the ignored id."""

    logits: Tensor
    targets: Tensor
    ignore_index: int


class LossParts(NamedTuple):
    """Summed loss over ``count`` predictions."""

    total: Tensor
    count: Tensor


def _seq2seq(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int) -> Predictions:
    with masking_heads(model, head_mask):
        return Predictions(model(batch.src, batch.tgt_in), batch.tgt_out, pad_id)


def _classification(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int) -> Predictions:
    with masking_heads(model, head_mask):
        return Predictions(model(batch.src), batch.labels, -100)


def _language_model(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int) -> Predictions:
    with masking_heads(model, head_mask):
        return Predictions(model(batch.tgt_in), batch.tgt_out, pad_id)


PREDICTIONS: dict[str, Callable[[nn.Module, Batch, Mapping[str, Tensor] | None, int], Predictions]] = {
    "encoder_decoder": _seq2seq,
    "encoder_classifier": _classification,
    "decoder_only": _language_model,
}
"""Registry: model kind -> predictions(model, batch, head_mask, pad_id); the model runs under the head
mask (:func:`attnlab.nn.masking_heads`; None: every head on)."""


def _token_losses(predictions: Predictions, label_smoothing: float) -> tuple[Tensor, Tensor]:
    """Per-prediction losses and the mask of real (non-ignored) predictions, shaped like the targets."""
    logits, targets, ignore = predictions
    losses = F.cross_entropy(  # fp16/bf16 logits are scored in fp32; fp64 keeps its precision
        logits.reshape(-1, logits.shape[-1]).to(torch.promote_types(logits.dtype, torch.float32)),
        targets.reshape(-1),
        ignore_index=ignore,
        reduction="none",
        label_smoothing=label_smoothing,
    ).view(targets.shape)
    return losses, targets != ignore


def next_symbol_targets(next_symbols: Tensor, vocab_size: int) -> Tensor:
    """The multi-hot targets of bit masks: y[b, t, c] = bit ``FIRST_PREDICTED_ID + c`` of the mask.

    Shape:
        next_symbols: (B, T) int64;  returns (B, T, vocab_size - FIRST_PREDICTED_ID) bool.
    """
    ids = torch.arange(FIRST_PREDICTED_ID, vocab_size, device=next_symbols.device)
    return ((next_symbols.unsqueeze(-1) >> ids) & 1).bool()


def _squared_error(scores: Tensor, targets: Tensor, reduction: str) -> Tensor:
    """(sigmoid(z) - y)², elementwise (``reduction`` must be ``none``)."""
    return (torch.sigmoid(scores) - targets) ** 2


SYMBOL_LOSSES: dict[str, Callable[..., Tensor]] = {
    "bce": F.binary_cross_entropy_with_logits,
    "mse": _squared_error,
}
"""Registry: ``train.loss`` -> the loss of one sigmoid logit z against its 0/1 target y, elementwise:
``bce`` -[y log s(z) + (1 - y) log(1 - s(z))], ``mse`` (s(z) - y)² (Bhattamishra et al. 2020)."""


def _next_symbol_losses(
    model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, loss: str = "bce"
) -> tuple[Tensor, Tensor]:
    """The ``loss`` (:data:`SYMBOL_LOSSES`) per (position, symbol), (B, T, K), zero at padding, and
    the (B, T) mask of real positions."""
    with masking_heads(model, head_mask):
        logits = model(batch.tgt_in)
    targets = next_symbol_targets(batch.next_symbols, logits.shape[-1])
    scores = logits[..., FIRST_PREDICTED_ID:].to(torch.promote_types(logits.dtype, torch.float32))
    losses = SYMBOL_LOSSES[loss](scores, targets.to(scores.dtype), reduction="none")
    return losses * batch.tgt_is_token.unsqueeze(-1), batch.tgt_is_token


def _summed(
    kind: str,
    model: nn.Module,
    batch: Batch,
    head_mask: Mapping[str, Tensor] | None,
    pad_id: int,
    label_smoothing: float,
    loss: str = "bce",
) -> LossParts:
    if batch.next_symbols is not None:  # label smoothing applies to the softmax objectives only
        losses, real = _next_symbol_losses(model, batch, head_mask, loss)
        return LossParts(losses.sum(), real.sum())
    losses, real = _token_losses(PREDICTIONS[kind](model, batch, head_mask, pad_id), label_smoothing)
    return LossParts(losses.sum(), real.sum())


OBJECTIVES: dict[str, Callable[..., LossParts]] = {kind: partial(_summed, kind) for kind in PREDICTIONS}
"""Registry: model kind -> objective(model, batch, head_mask, pad_id, label_smoothing, loss="bce") ->
LossParts; ``loss`` (:data:`SYMBOL_LOSSES`) applies to the per-symbol sigmoids of ``next_char``."""


def example_losses(
    kind: str, model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int
) -> Tensor:
    """The mean loss of each example of the batch, shape (B,), differentiable."""
    if batch.next_symbols is not None:
        losses, real = _next_symbol_losses(model, batch, head_mask)
        return losses.sum((1, 2)) / real.sum(1).clamp_min(1)
    losses, real = _token_losses(PREDICTIONS[kind](model, batch, head_mask, pad_id), 0.0)
    if losses.dim() == 1:  # one prediction per example (classification)
        return losses
    return losses.sum(1) / real.sum(1).clamp_min(1)
