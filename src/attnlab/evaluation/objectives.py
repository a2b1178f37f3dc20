"""The loss of each model kind: which logits predict which targets.

* encoder_decoder: teacher forcing with the target shifted right (Agarwal §5.2): the decoder reads
  ``tgt_in`` = BOS + y and predicts ``tgt_out`` = y + EOS; padding ignored.
* encoder_classifier: the label read at the EOS position (Hahn §3).
* decoder_only: next-token prediction over ``tgt_in`` -> ``tgt_out``.

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

from attnlab.tasks.batching import Batch

__all__ = ["LossParts", "Predictions", "PREDICTIONS", "OBJECTIVES", "example_losses"]


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
    return Predictions(model(batch.src, batch.tgt_in, head_mask=head_mask), batch.tgt_out, pad_id)


def _classification(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int) -> Predictions:
    return Predictions(model(batch.src, head_mask=head_mask), batch.labels, -100)


def _language_model(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int) -> Predictions:
    return Predictions(model(batch.tgt_in, head_mask=head_mask), batch.tgt_out, pad_id)


PREDICTIONS: dict[str, Callable[[nn.Module, Batch, Mapping[str, Tensor] | None, int], Predictions]] = {
    "encoder_decoder": _seq2seq,
    "encoder_classifier": _classification,
    "decoder_only": _language_model,
}
"""Registry: model kind -> predictions(model, batch, head_mask, pad_id)."""


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


def _summed(
    kind: str,
    model: nn.Module,
    batch: Batch,
    head_mask: Mapping[str, Tensor] | None,
    pad_id: int,
    label_smoothing: float,
) -> LossParts:
    losses, real = _token_losses(PREDICTIONS[kind](model, batch, head_mask, pad_id), label_smoothing)
    return LossParts(losses.sum(), real.sum())


OBJECTIVES: dict[str, Callable[..., LossParts]] = {kind: partial(_summed, kind) for kind in PREDICTIONS}
"""Registry: model kind -> objective(model, batch, head_mask, pad_id, label_smoothing) -> LossParts."""


def example_losses(
    kind: str, model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int
) -> Tensor:
    """The mean loss of each example of the batch, shape (B,), differentiable."""
    losses, real = _token_losses(PREDICTIONS[kind](model, batch, head_mask, pad_id), 0.0)
    if losses.dim() == 1:  # one prediction per example (classification)
        return losses
    return losses.sum(1) / real.sum(1).clamp_min(1)
