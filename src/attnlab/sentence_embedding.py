"""Sentence embeddings from an encoder run: the last hidden states, pooled over the real tokens.

For all-MiniLM-L6-v2 (sentence-transformers) the embedding of a text x with tokens t_1..t_T is
the mean of the last hidden states over the positions that are not padding,

    e(x) = sum_t m_t y_t^(L) / sum_t m_t,        m_t = 1 if t is a real token, else 0,

``[CLS]`` and ``[SEP]`` included (``pooling='mean'``); ``pooling='first'`` reads y_1^(L), the
``[CLS]`` position. Head masks pass through, so the same function serves head analysis (Michel §2.3).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.errors import UsageError
from attnlab.nn import masking_heads
from attnlab.nn.models import POOLINGS
from attnlab.run.loaded import LoadedRun
from attnlab.tasks.base import Example
from attnlab.tasks.batching import collate

__all__ = ["EncodedText", "sentence_embeddings", "check_encoder_run", "pad_ids", "encode_texts"]


@dataclass(frozen=True)
class EncodedText:
    """One text through the encoder.

    Attributes:
        text: the input.
        tokens: its WordPiece tokens, ``[CLS]`` and ``[SEP]`` included (T of them).
        hidden: (T, d_model) last hidden states.
        embedding: (d_model,) the pooled sentence embedding.
    """

    text: str
    tokens: list[str]
    hidden: Tensor
    embedding: Tensor


def sentence_embeddings(
    model: nn.Module,
    tokens: Tensor,
    *,
    pad_id: int,
    pooling: str = "mean",
    head_mask: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """e(x) for each row of ``tokens`` (B, T) -> (B, d_model); differentiable in ``head_mask``."""
    with masking_heads(model, head_mask):
        hidden = model(tokens)
    return POOLINGS[pooling](hidden, tokens != pad_id)


def check_encoder_run(loaded: LoadedRun, what: str) -> None:
    """Raise UsageError unless ``loaded`` is a sentence encoder (model kind ``encoder``)."""
    if not loaded.experiment.model_config_class.embeds_sentences:
        raise UsageError(
            f"{what} needs a sentence encoder run (model kind 'encoder', e.g. from `attnlab import bert`); "
            f"{loaded.source} is a {loaded.experiment.model_kind} run"
        )


def pad_ids(rows: Sequence[Sequence[int]], *, pad_id: int) -> Tensor:
    """Rows of ids padded to one (B, T) tensor."""
    return collate([Example(source=tuple(r)) for r in rows], pad_id=pad_id, bos_id=pad_id, eos_id=pad_id).src


@torch.no_grad()
def encode_texts(loaded: LoadedRun, texts: Sequence[str], *, batch_size: int = 32) -> list[EncodedText]:
    """Tokens, last hidden states and sentence embedding of every text, in order (the run's held
    heads, ``train.mask_heads``, off)."""
    check_encoder_run(loaded, "encoding texts")
    if not texts:
        raise UsageError("give at least one text")
    task, codec, model = loaded.task, loaded.codec, loaded.model
    device = next(model.parameters()).device
    out: list[EncodedText] = []
    for start in range(0, len(texts), batch_size):
        chunk = list(texts[start : start + batch_size])
        ids = [codec.encode(text) for text in chunk]
        tokens = pad_ids(ids, pad_id=task.pad_id).to(device)
        with masking_heads(model, loaded.held_mask()):
            hidden = model(tokens)
        pooled = POOLINGS[task.pooling](hidden, tokens != task.pad_id)
        for row, (text, row_ids) in enumerate(zip(chunk, ids, strict=True)):
            out.append(EncodedText(text, codec.tokens(row_ids), hidden[row, : len(row_ids)].cpu(), pooled[row].cpu()))
    return out
