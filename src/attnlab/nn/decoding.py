"""What a model keeps between decoding steps: its :class:`DecodingState` (a KV cache per layer,
which keys are real tokens, planned positions), and an encoder-decoder's :class:`EncodedSource`
(the encoder output z_{1:T}, computed once per source). Both follow beam search's reordering of
the batch rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["DecodingState", "EncodedSource"]


@dataclass
class DecodingState:
    """What a model keeps between decoding steps: one KV cache per layer, and which keys so far
    are real tokens (so a padding token fed at step t stays masked at every later step).

    Attributes:
        layers: a :class:`KVCache` (decoder-only) or :class:`DecoderLayerCache` per layer.
        is_token: (B, T_k) bool over all keys seen so far, or None before the first step.
        positions: (B, T_p) positions planned for the tokens to come (randomized-position evaluation
            of a generating decoder, :func:`attnlab.nn.token_positions.planned_positions`), or None for 0, 1, ...
    """

    layers: list[Any]
    is_token: Tensor | None = None
    positions: Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.is_token is None else self.is_token.shape[1]

    def advance(self, new_is_token: Tensor) -> Tensor:
        """Record the new positions; return (B, T_k) for all keys so far."""
        self.is_token = new_is_token if self.is_token is None else torch.cat([self.is_token, new_is_token], dim=1)
        return self.is_token

    def reorder(self, index: Tensor) -> None:
        """Keep batch rows ``index`` (beam search)."""
        for cache in self.layers:
            cache.reorder(index)
        if self.is_token is not None:
            self.is_token = self.is_token.index_select(0, index)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, index)


class EncodedSource(NamedTuple):
    """The encoder output z_{1:T} and which of its positions are real tokens.

    Shape:
        states: (B, T_src, d_model);  is_token: (B, T_src) bool.
    """

    states: Tensor
    is_token: Tensor

    def reorder(self, index: Tensor) -> EncodedSource:
        return EncodedSource(self.states.index_select(0, index), self.is_token.index_select(0, index))
