"""Which position each token of a stack takes: the default 0, 1, ... from a KV cache's offset,
each real token's index among the real tokens (left padding), randomized positions (Ruoss et al.
2023), or positions planned for a generating decoder.

A stack chooses once, from its config, how it places its tokens (:class:`PositionPlacer`); one
forward pass gives a :class:`Placement`: the queries' and keys' positions for encodings inside
attention (rotary, position biases) and the embedding's (randomized positions, left padding).
:func:`drawing_positions` makes evaluation draw randomized positions as training does, seeded per
sequence; :func:`planned_positions` gives a generating decoder those of its teacher-forced pass.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.nn.config import TransformerConfig
from attnlab.nn.position_bias import POSITION_BIASES
from attnlab.nn.positional import randomized_positions
from attnlab.nn.rotary import positions_of_tokens

__all__ = ["IN_ATTENTION", "Placement", "PositionPlacer", "planned_positions", "drawing_positions"]


IN_ATTENTION = ("rope", *POSITION_BIASES)
"""Encodings that act inside self-attention, from explicit query and key positions."""


class Placement(NamedTuple):
    """The positions one forward pass of a stack uses (None: the default, offset + 0, 1, ...).

    Attributes:
        queries: (B, T) positions of the new tokens, for rotary attention and position biases.
        keys: (B, T_k) positions of every key so far (the cache's included), for position biases.
        embedding: (B, T) positions for the embedding's table (randomized positions only).
    """

    queries: Tensor | None
    keys: Tensor | None
    embedding: Tensor | None


class PositionPlacer:
    """Which positions a stack's tokens take, chosen once from the config.

    * with ``planned`` positions (a generating decoder in randomized-position evaluation,
      :func:`planned_positions`): those, in order;
    * in training with ``randomized_positions = M`` (no cache): a sorted random subset of [0, M)
      per row (:func:`attnlab.nn.positional.randomized_positions`, Ruoss et al. 2023), for the
      embedding's table and for attention alike, drawn from torch's global generator; in
      evaluation too inside :func:`drawing_positions`, each row from a generator seeded from the
      block's seed and the row's tokens;
    * otherwise, for encodings inside attention: each real token's index among the real tokens
      (:func:`attnlab.nn.rotary.positions_of_tokens`), so left padding does not shift them;
    * otherwise, where some keys are padding (a left-padded batch of prompts), the same indices
      for the embedding's table (GPT-2's learned positions start at 0 on each row's first token,
      as Hugging Face's ``generate`` places them);
    * otherwise none: the embedding counts from the cache's offset.
    """

    def __init__(self, config: TransformerConfig) -> None:
        self.in_attention = config.positional in IN_ATTENTION
        self.in_embedding = config.positional != "none" and not self.in_attention
        self.limit = config.randomized_positions or 0
        self.seed: int | None = None  # set inside drawing_positions only

    def __call__(
        self,
        keys_are_tokens: Tensor,
        new: int,
        *,
        training: bool,
        cached: bool,
        tokens: Tensor | None = None,
        planned: Tensor | None = None,
    ) -> Placement:
        if planned is not None:  # a generating decoder's planned positions, extended past their end
            keys = _extended(planned, keys_are_tokens.shape[1], self.limit)  # (B, T_k)
            return Placement(keys[:, -new:], keys, keys[:, -new:])
        if self.limit and not cached and training:
            sampled = randomized_positions(keys_are_tokens, self.limit)  # (B, T)
            return Placement(sampled, sampled, sampled)
        if self.limit and not cached and self.seed is not None and tokens is not None:
            sampled = self._drawn_per_row(keys_are_tokens, tokens, self.seed)  # (B, T)
            return Placement(sampled, sampled, sampled)
        if self.in_attention:
            keys = positions_of_tokens(keys_are_tokens, keys_are_tokens.shape[1])  # (B, T_k)
            return Placement(keys[:, -new:], keys, None)
        if self.in_embedding and not bool(keys_are_tokens[:, 0].all()):  # a row starts with padding
            return Placement(None, None, positions_of_tokens(keys_are_tokens, new))  # (B, T)
        return Placement(None, None, None)

    def _drawn_per_row(self, is_token: Tensor, tokens: Tensor, seed: int) -> Tensor:
        """Randomized positions for each row from a generator of its own, seeded from ``seed`` and the
        row's real tokens: a row's positions depend on nothing else (not on the batch it is in).

        Shape:
            is_token, tokens: (B, T);  returns (B, T) int64.
        """
        rows = []
        for row_is_token, row_tokens in zip(is_token, tokens):
            ids = row_tokens[row_is_token].tolist()
            digest = hashlib.sha256(f"{seed}:{ids}".encode()).digest()
            generator = torch.Generator().manual_seed(int.from_bytes(digest[:8], "big") >> 1)
            rows.append(randomized_positions(row_is_token.unsqueeze(0), self.limit, generator=generator))
        return torch.cat(rows)


def _one_by_one_past(positions: Tensor, count: Tensor | int, limit: int) -> Tensor:
    """``positions`` (B, T) up to each row's first ``count`` columns ((B, 1) or one for all); past
    them, one more than the last each column, capped at M - 1."""
    columns = torch.arange(positions.shape[1], device=positions.device).unsqueeze(0)  # (1, T)
    count = torch.as_tensor(count, device=positions.device).reshape(-1, 1)  # (B or 1, 1)
    last = positions.gather(1, (count - 1).clamp(min=0).expand(positions.shape[0], 1))  # (B, 1)
    return torch.where(columns < count, positions, (last + columns - count + 1).clamp(max=limit - 1))


def _extended(planned: Tensor, length: int, limit: int) -> Tensor:
    """The first ``length`` columns of ``planned`` (B, T_p); past its end, one by one (a generation
    running past the planned length)."""
    if length <= planned.shape[1]:
        return planned[:, :length]
    return _one_by_one_past(F.pad(planned, (0, length - planned.shape[1])), planned.shape[1], limit)


def planned_positions(model: nn.Module, tokens: Tensor, pad_id: int) -> Tensor | None:
    """The positions an encoder-decoder's decoder gives ``tokens`` (B, T: BOS + an output) inside
    :func:`drawing_positions`, as its forward pass without a cache draws them; None outside it.

    Randomized-position evaluation of a decoder that generates (Ruoss et al. 2023 give their
    non-autoregressive model the output's length |y|): the positions of BOS + the reference
    output, drawn as for the teacher-forced pass, placed one per generated token (in
    :attr:`attnlab.nn.decoding.DecodingState.positions`), so generation sees the training distribution of positions
    for its output's length; a generation running past it continues one by one.

    Shape:
        tokens: (B, T);  returns (B, T) int64 or None.
    """
    place = getattr(getattr(model, "decoder", None), "_place", None)
    if not isinstance(place, PositionPlacer) or place.seed is None or not place.limit:
        return None
    is_token = tokens != pad_id  # BOS + output, padded on the right
    drawn = place._drawn_per_row(is_token, tokens, place.seed)  # (B, T)
    return _one_by_one_past(drawn, is_token.sum(dim=1, keepdim=True), place.limit)  # a row's padding too


@contextlib.contextmanager
def drawing_positions(model: nn.Module, seed: int | None) -> Iterator[None]:
    """Inside the block, ``model`` in evaluation places its tokens as training does with
    ``randomized_positions = M``: a sorted random subset of [0, M) per sequence (Ruoss et al. 2023),
    drawn for each sequence from a generator seeded from ``seed`` and its tokens (the same sequence
    gets the same positions in any batch), never from torch's global generator, which stays
    untouched. A decoder generating with a KV cache takes the positions planned in its state
    (:func:`planned_positions`), else 0, 1, ... None changes nothing.

    Raises:
        ValueError: naming ``randomized_positions`` when no stack of ``model`` draws positions.
    """
    if seed is None:
        yield
        return
    placers = [
        place for module in model.modules() if isinstance(place := getattr(module, "_place", None), PositionPlacer)
    ]
    if not any(place.limit for place in placers):
        raise ValueError("randomized_positions: the model was not built with randomized positions (M = 0)")
    for place in placers:
        place.seed = seed
    try:
        yield
    finally:
        for place in placers:
            place.seed = None
