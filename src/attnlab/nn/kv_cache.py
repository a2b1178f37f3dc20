"""The keys and values one attention module keeps across decoding steps (:class:`KVCache`).

At step t only the new position's query, key and value are projected; the keys and values of
earlier positions are read back from the cache, so decoding T tokens projects each position once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["KVCache"]


class KVCache:
    """Projected keys and values kept across decoding steps, for one attention module.

    * self-attention: :meth:`append` adds this step's keys/values and returns all so far;
    * encoder-decoder attention: the memory is projected once and kept (:meth:`keep`).

    Appended keys and values are written into preallocated buffers whose length doubles when
    full, so a step copies only its own new rows (growing by ``torch.cat`` would copy the whole
    cache every step: O(T^2) copying for T steps). :attr:`key` and :attr:`value` are views of the
    filled part.

    Shape:
        key: (B, H, T_k, d_k);  value: (B, H, T_k, d_v).
    """

    def __init__(self) -> None:
        self._keys: Tensor | None = None  # (B, H, capacity, d_k)
        self._values: Tensor | None = None  # (B, H, capacity, d_v)
        self._length = 0

    def __len__(self) -> int:
        return self._length

    @property
    def key(self) -> Tensor | None:
        return None if self._keys is None else self._keys[:, :, : self._length]

    @property
    def value(self) -> Tensor | None:
        return None if self._values is None else self._values[:, :, : self._length]

    def append(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
            return self._append_in_graph(key, value)
        new = key.shape[-2]
        if self._keys is None or self._values is None:
            self._keys, self._values = _with_capacity(key, new), _with_capacity(value, new)
        elif self._length + new > self._keys.shape[-2]:
            capacity = max(2 * self._keys.shape[-2], self._length + new)
            self._keys = _grown(self._keys, self._length, capacity)
            self._values = _grown(self._values, self._length, capacity)
        self._keys[:, :, self._length : self._length + new] = key
        self._values[:, :, self._length : self._length + new] = value
        self._length += new
        return self.key, self.value  # type: ignore[return-value]

    def _append_in_graph(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Concatenate instead: writing into a buffer in place would invalidate the views that
        earlier steps saved for the backward pass."""
        if self._keys is None or self._values is None:
            self._keys, self._values = key, value
        else:
            self._keys = torch.cat([self.key, key], dim=-2)  # type: ignore[list-item]
            self._values = torch.cat([self.value, value], dim=-2)  # type: ignore[list-item]
        self._length = self._keys.shape[-2]
        return self._keys, self._values

    def keep(self, project: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
        if self._keys is None or self._values is None:
            keys, values = project()
            # Stored contiguous: every later step streams them, and the head-split view of the fused
            # K|V projection (rows of d_k floats 2 * d_model apart) streams more slowly from memory
            # (benchmarks/README.md).
            self._keys, self._values = keys.contiguous(), values.contiguous()
            self._length = self._keys.shape[-2]
        return self.key, self.value  # type: ignore[return-value]

    def reorder(self, index: Tensor) -> None:
        """Select batch rows (beam search): key/value become key[index]/value[index]."""
        if self._keys is not None and self._values is not None:
            self._keys, self._values = self._keys.index_select(0, index), self._values.index_select(0, index)


def _with_capacity(rows: Tensor, length: int, minimum: int = 16) -> Tensor:
    """An empty (B, H, max(2 * length, minimum), d) buffer like ``rows``."""
    batch, heads, _, width = rows.shape
    return rows.new_empty(batch, heads, max(2 * length, minimum), width)


def _grown(buffer: Tensor, length: int, capacity: int) -> Tensor:
    """A buffer of ``capacity`` positions holding the first ``length`` of ``buffer``."""
    batch, heads, _, width = buffer.shape
    grown = buffer.new_empty(batch, heads, capacity, width)
    grown[:, :, :length] = buffer[:, :, :length]
    return grown
