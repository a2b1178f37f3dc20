"""Endless, resumable streams of training batches, dealt out over processes: epochs of a fixed
training split (:class:`BatchStream`), or a batch drawn afresh from the task at every step
(:class:`FreshStream`, ``task.fresh_examples``)."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

import torch

from attnlab.errors import ConfigError
from attnlab.tasks.base import Example
from attnlab.tasks.batching import Batch, collate, fit_length, make_batches
from attnlab.training.distributed import DistInfo

__all__ = ["BatchStream", "FreshStream", "rows_of"]


def rows_of(batch: Batch, index: torch.Tensor | slice) -> Batch:
    """The rows ``index`` of every tensor in ``batch``."""
    values = {f.name: getattr(batch, f.name) for f in fields(batch)}
    return Batch(**{k: (v[index] if isinstance(v, torch.Tensor) else v) for k, v in values.items()})


@dataclass
class StreamPosition:
    epoch: int = 0
    index: int = 0


def _check_batch_size(batch_size: int, dist: DistInfo) -> None:
    """Refuse a global batch of fewer rows than processes (one would train on nothing)."""
    if batch_size < dist.world_size:
        raise ConfigError(f"train.batch_size={batch_size} is smaller than the {dist.world_size} processes")


class _Stream:
    """What every stream shares: its position, which is all a resume restores, and this process's
    rows of a global batch."""

    dist: DistInfo
    position: StreamPosition

    def _own_rows(self, batch: Batch) -> Batch:
        """Every process draws the same global batch and keeps rows rank, rank + N, ..."""
        if not self.dist.enabled:
            return batch
        return rows_of(batch, slice(self.dist.rank, None, self.dist.world_size))

    def state(self) -> dict[str, int]:
        return {"epoch": self.position.epoch, "index": self.position.index}

    def restore(self, state: Mapping[str, int]) -> None:
        self.position = StreamPosition(int(state["epoch"]), int(state["index"]))


class BatchStream(_Stream):
    """Endless training batches: epoch after epoch, each shuffled by (seed, epoch).

    ``position`` (epoch, batch index) is all it takes to continue exactly where a run stopped.
    With several processes, every process draws the same global batch and keeps its own rows.
    """

    def __init__(
        self,
        examples: Sequence[Example],
        batch_size: int,
        *,
        pad_id: int,
        bos_id: int,
        eos_id: int,
        seed: int,
        max_length: int | None,
        truncate: bool,
        dist: DistInfo,
    ) -> None:
        if not examples:
            raise ConfigError("the task's train split is empty: nothing to train on")
        _check_batch_size(batch_size, dist)
        self._examples = list(examples)
        self._options = dict(
            pad_id=pad_id, bos_id=bos_id, eos_id=eos_id, seed=seed, max_length=max_length, truncate=truncate
        )
        self.batch_size = batch_size
        self.dist = dist
        self.position = StreamPosition()
        self._epoch_batches: list[Batch] | None = None
        self._batches_epoch = -1

    def _batches(self, epoch: int) -> list[Batch]:
        if self._batches_epoch != epoch:
            self._epoch_batches = list(make_batches(self._examples, self.batch_size, epoch=epoch, **self._options))
            self._batches_epoch = epoch
        return self._epoch_batches  # type: ignore[return-value]

    def next(self) -> Batch:
        """This process's rows of the next global batch."""
        if self.position.index >= len(self._batches(self.position.epoch)):
            self.position = StreamPosition(self.position.epoch + 1, 0)
        batch = self._batches(self.position.epoch)[self.position.index]
        self.position = StreamPosition(self.position.epoch, self.position.index + 1)
        return self._own_rows(batch)


class FreshTask(Protocol):
    """A task that can draw training examples afresh (``task.fresh_examples``)."""

    def fresh_train(self, rng: random.Random, size: int) -> list[Example]: ...


class FreshStream(_Stream):
    """Endless training batches, each drawn afresh from the task (Delétang et al. 2023: no fixed
    training set): batch i is ``task.fresh_train(Random(f"{seed}:fresh:{i}"), batch_size)``.

    A batch depends on (seed, i) alone, so ``position`` (epoch 0, batch index) is all a resume
    needs, and the batches after it are those of an uninterrupted run. With several processes,
    every process draws the same global batch and keeps its own rows, as :class:`BatchStream`.
    """

    def __init__(
        self,
        task: FreshTask,
        batch_size: int,
        *,
        pad_id: int,
        bos_id: int,
        eos_id: int,
        seed: int,
        max_length: int | None,
        truncate: bool,
        dist: DistInfo,
    ) -> None:
        _check_batch_size(batch_size, dist)
        self.task, self.batch_size, self.dist, self.seed = task, batch_size, dist, seed
        self._ids = dict(pad_id=pad_id, bos_id=bos_id, eos_id=eos_id)
        self._fit: dict[str, Any] = dict(max_length=max_length, truncate=truncate, eos_id=eos_id)
        self.position = StreamPosition()

    def next(self) -> Batch:
        """This process's rows of the next global batch."""
        rng = random.Random(f"{self.seed}:fresh:{self.position.index}")
        examples = self.task.fresh_train(rng, self.batch_size)
        if self._fit["max_length"] is not None:
            examples = fit_length(examples, **self._fit)
        batch = collate(examples, **self._ids)
        self.position = StreamPosition(0, self.position.index + 1)
        return self._own_rows(batch)
