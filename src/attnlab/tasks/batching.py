"""Batches: pad with masks, bucket by length, shuffle deterministically by seed.

A :class:`Batch` holds named tensors, never a positional tuple. Padding uses the task's ``pad_id``
and every padded tensor comes with its boolean "is a real token" mask (True = token), the form
:func:`attnlab.nn.masks.padding_mask` takes.

Sequences longer than the model's ``max_length`` are rejected with a :class:`DataError`, or cut
when the caller opts in with ``truncate=True`` (sources keep their final EOS). Labelled
(recognition) examples are never truncated: cutting a string changes whether it is in the
language, so its label would be wrong.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from attnlab.errors import ConfigError, DataError
from attnlab.tasks.base import Example

__all__ = ["Batch", "collate", "fit_length", "make_batches"]

BUCKET_BATCHES = 50
"""Examples are sorted by length within pools of this many batches: little padding, yet random."""


@dataclass(frozen=True)
class Batch:
    """A padded batch. Fields a task does not use are None.

    Shape:
        src, src_is_token: (B, T_src) int64 / bool. Recognition and seq2seq sources.
        tgt_in, tgt_out, tgt_is_token: (B, T_tgt). tgt_in = BOS + target, tgt_out = target + EOS.
        labels: (B,) int64, recognition only.
        next_symbols: (B, T_tgt) int64, ``next_char`` recognition only: at each position of
            ``tgt_in`` the bit mask of the token ids that may come next (0 at padding).
        lengths: (B,) int64, unpadded length of ``src`` (or of ``tgt_in`` when there is no src).
        split_lengths: (B,) int64, each example's :attr:`Example.length`, the length that decides
            its split (symbols before EOS, an operand width), which accuracy per length is keyed by.
    """

    lengths: Tensor
    split_lengths: Tensor | None = None
    src: Tensor | None = None
    src_is_token: Tensor | None = None
    tgt_in: Tensor | None = None
    tgt_out: Tensor | None = None
    tgt_is_token: Tensor | None = None
    labels: Tensor | None = None
    next_symbols: Tensor | None = None

    def __len__(self) -> int:
        return self.lengths.shape[0]

    def to(self, device: torch.device | str) -> Batch:
        moved = {k: (v.to(device) if isinstance(v, Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**moved)


def _pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    width = max((len(r) for r in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    is_token = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row, dtype=torch.int64)
        is_token[i, : len(row)] = True
    return ids, is_token


def collate(examples: Sequence[Example], *, pad_id: int, bos_id: int, eos_id: int) -> Batch:
    """Pad ``examples`` into one :class:`Batch`."""
    if not examples:
        raise ValueError("collate: no examples")
    fields: dict[str, Tensor] = {}
    has_src = any(len(e.source) for e in examples)
    if has_src:
        fields["src"], fields["src_is_token"] = _pad([e.source for e in examples], pad_id)
    if examples[0].target is not None:
        targets = [e.target or () for e in examples]
        fields["tgt_in"], fields["tgt_is_token"] = _pad([(bos_id, *t) for t in targets], pad_id)
        fields["tgt_out"], _ = _pad([(*t, eos_id) for t in targets], pad_id)
    if examples[0].next_symbols is not None:
        fields["next_symbols"], _ = _pad([e.next_symbols or () for e in examples], 0)
    if examples[0].label is not None:
        fields["labels"] = torch.tensor([e.label for e in examples], dtype=torch.int64)
    mask = fields["src_is_token"] if has_src else fields["tgt_is_token"]
    split_lengths = torch.tensor([e.length for e in examples], dtype=torch.int64)
    return Batch(lengths=mask.sum(dim=1), split_lengths=split_lengths, **fields)


def fit_length(examples: Sequence[Example], max_length: int, *, eos_id: int, truncate: bool = False) -> list[Example]:
    """Check every sequence fits ``max_length`` positions; cut the long ones only if ``truncate``.

    A target needs ``len(target) + 1`` positions (BOS or EOS is added to it).

    Raises:
        DataError: a sequence is too long and ``truncate`` is False (names the example).
        ConfigError: ``truncate`` was asked for labelled examples.
    """
    if max_length < 2:
        raise ConfigError(f"max_length: must be >= 2, got {max_length}")
    out = []
    for index, example in enumerate(examples):
        src_len = len(example.source)
        tgt_len = len(example.target) + 1 if example.target is not None else 0
        if max(src_len, tgt_len) <= max_length:
            out.append(example)
            continue
        if not truncate:
            which, n = ("source", src_len) if src_len > max_length else ("target", tgt_len)
            raise DataError(
                f"example {index}: the {which} needs {n} positions, more than the model's "
                f"max_length={max_length}; shorten it, or opt in to truncation "
                "(--set train.truncate=true to train, attnlab eval --truncate)"
            )
        if example.label is not None:
            raise ConfigError(
                f"train.truncate / --truncate: example {index} is labelled; cutting a string can change "
                "its label, so recognition examples are never truncated"
            )
        source = example.source
        if src_len > max_length:
            keep_eos = source[-1:] == (eos_id,)
            source = source[: max_length - 1] + (eos_id,) if keep_eos else source[:max_length]
        target = example.target[: max_length - 1] if example.target is not None else None
        out.append(replace(example, source=source, target=target))
    return out


def count_too_long(examples: Sequence[Example], max_length: int) -> int:
    """How many of ``examples`` :func:`fit_length` would cut (or reject) at ``max_length``."""
    return sum(max(len(e.source), len(e.target) + 1 if e.target is not None else 0) > max_length for e in examples)


def make_batches(
    examples: Sequence[Example],
    batch_size: int,
    *,
    pad_id: int,
    bos_id: int,
    eos_id: int,
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    bucket: bool = True,
    max_length: int | None = None,
    truncate: bool = False,
) -> Iterator[Batch]:
    """Yield batches of ``examples``: checked against ``max_length``, bucketed, shuffled.

    With ``shuffle``, the order depends only on (``seed``, ``epoch``): the same arguments give
    the same batches in every run. With ``bucket``, examples are sorted by length inside pools
    of :data:`BUCKET_BATCHES` batches, so a batch holds similar lengths and little padding.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size: must be >= 1, got {batch_size}")
    if max_length is not None:
        examples = fit_length(examples, max_length, eos_id=eos_id, truncate=truncate)
    order = list(range(len(examples)))
    rng = random.Random(f"{seed}:{epoch}")
    if shuffle:
        rng.shuffle(order)
    groups: list[list[int]] = []
    pool = batch_size * BUCKET_BATCHES if bucket else len(order) or 1
    for start in range(0, len(order), pool):
        chunk = order[start : start + pool]
        if bucket:
            chunk.sort(key=lambda i: (len(examples[i].source), len(examples[i].target or ())))
        groups.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
    if shuffle and bucket:
        rng.shuffle(groups)  # sorted pools would otherwise feed short batches first
    for group in groups:
        yield collate([examples[i] for i in group], pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
