"""The training loss of each model kind, as (summed loss, number of predictions).

Returning the sum and the count, not the mean, lets distributed training divide by the global
count (see :mod:`attnlab.training.distributed`).

* encoder_decoder: teacher forcing with the target shifted right (Agarwal §5.2): the decoder reads
  ``tgt_in`` = BOS + y and predicts ``tgt_out`` = y + EOS; cross-entropy with label smoothing
  (Vaswani §5.4), padding ignored.
* encoder_classifier: cross-entropy of the label read at the EOS position (Hahn §3).
* decoder_only: next-token cross-entropy over ``tgt_in`` -> ``tgt_out``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple


import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.tasks.batching import Batch

__all__ = ["LossParts", "OBJECTIVES", "predictions_loss"]


class LossParts(NamedTuple):
    """Summed loss over ``count`` predictions."""

    total: Tensor
    count: Tensor


def predictions_loss(logits: Tensor, targets: Tensor, *, pad_id: int | None, label_smoothing: float) -> LossParts:
    """Summed cross-entropy over the non-padding targets."""
    flat_targets = targets.reshape(-1)
    ignore = -100 if pad_id is None else pad_id
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        flat_targets,
        ignore_index=ignore,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    count = (flat_targets != ignore).sum()
    return LossParts(total, count)


def _seq2seq(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int, label_smoothing: float) -> LossParts:
    logits = model(batch.src, batch.tgt_in, head_mask=head_mask)
    return predictions_loss(logits, batch.tgt_out, pad_id=pad_id, label_smoothing=label_smoothing)


def _classification(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int, label_smoothing: float) -> LossParts:
    logits = model(batch.src, head_mask=head_mask)
    return predictions_loss(logits, batch.labels, pad_id=None, label_smoothing=label_smoothing)


def _language_model(model: nn.Module, batch: Batch, head_mask: Mapping[str, Tensor] | None, pad_id: int, label_smoothing: float) -> LossParts:
    logits = model(batch.tgt_in, head_mask=head_mask)
    return predictions_loss(logits, batch.tgt_out, pad_id=pad_id, label_smoothing=label_smoothing)


Objective = Callable[[nn.Module, Batch, "Mapping[str, Tensor] | None", int, float], LossParts]

OBJECTIVES: dict[str, Objective] = {
    "encoder_decoder": _seq2seq,
    "encoder_classifier": _classification,
    "decoder_only": _language_model,
}
"""Registry: model kind -> objective(model, batch, head_mask, pad_id, label_smoothing)."""


