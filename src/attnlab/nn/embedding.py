"""Layer 0, the input embedding: y_i^(0) = Norm(f(s E[x_i], p_i) + T[t_i]) (Hahn §3; Vaswani
§3.4-3.5; Agarwal §6.3).

s E[x_i] is the scaled token embedding, f adds or concatenates the positional encoding p_i
(:mod:`attnlab.nn.positional`), T[t_i] is BERT's token-type (segment) vector and Norm BERT's
embedding LayerNorm; without them both are the identity. Its named sites are ``STACK.embed``,
``STACK.pos_embed`` and ``STACK.embed_norm.*`` (:mod:`attnlab.nn.hooks`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from attnlab.kernels import Dropout
from attnlab.nn.config import TransformerConfig
from attnlab.nn.hooks import Hook, run_hooks
from attnlab.nn.normalization import NORMS
from attnlab.nn.positional import AddPositions, make_positional

__all__ = ["InputEmbedding", "TokenTypes", "EMBED_NORM_POINTS"]


class TokenTypes(nn.Module):
    """A learned vector per token type (BERT's segment A/B), added to every position.

    Without ``token_types`` every position has type 0, as in BERT when no segment ids are given.

    Shape:
        x: (B, T, d);  token_types: (B, T) int64 or None -> (B, T, d).
    """

    def __init__(self, types: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(types, dim) * 0.02)  # (types, d)

    def forward(self, x: Tensor, token_types: Tensor | None = None) -> Tensor:
        added = self.weight[0] if token_types is None else F.embedding(token_types, self.weight)
        return x + added.to(x.dtype)


def _no_token_types(x: Tensor, token_types: Tensor | None = None) -> Tensor:
    return x


def _check_ids(tokens: Tensor, vocab_size: int) -> None:
    """An id outside the vocabulary names itself (``nn.Embedding`` says "index out of range in self")."""
    if tokens.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(tokens))
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"tokens: id {bad} is outside the vocabulary [0, {vocab_size})")


class InputEmbedding(nn.Module):
    """Layer 0: y_i^(0) = Norm(f(s E[x_i], p_i) + T[t_i])  (Hahn §3; Vaswani §3.4-3.5; Agarwal §6.3).

    s = sqrt(d) when ``scale_embeddings`` (Vaswani §3.4), else 1, rounded to the embeddings' dtype
    before the product, as Hugging Face's Gemma computes it (in bfloat16, sqrt(640) = 25.298...
    becomes 25.25), so that the product equals Gemma's bit for bit. The token-type vector T[t_i] and
    the LayerNorm ``Norm`` are BERT's (``type_vocab_size`` > 0, ``embedding_norm``); without them
    they are the identity. Which of them exist is decided once, here, from the config.

    Shape:
        tokens: (B, T) int64;  token_types: (B, T) int64 or None (all type 0) -> (B, T, d_model).
    """

    def __init__(self, vocab_size: int, config: TransformerConfig) -> None:
        super().__init__()
        self.positional = make_positional(
            config.positional,
            d_model=config.d_model,
            max_len=config.max_len,
            combine=config.positional_combine,
            positional_dim=config.positional_width,
        )
        token_dim = self.positional.token_dim
        self.token = nn.Embedding(vocab_size, token_dim, padding_idx=config.pad_id)
        self.scale = math.sqrt(token_dim) if config.scale_embeddings else 1.0
        nn.init.normal_(self.token.weight, std=token_dim**-0.5 if config.scale_embeddings else 0.02)
        with torch.no_grad():
            self.token.weight[config.pad_id].zero_()
        self.token_type: Callable[..., Tensor] = (
            TokenTypes(config.type_vocab_size, config.d_model) if config.type_vocab_size > 0 else _no_token_types
        )
        self.norm = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps) if config.embedding_norm else nn.Identity()
        self.norm_points = EMBED_NORM_POINTS if config.embedding_norm else ()  # its named sites, if any
        self.dropout = Dropout(config.dropout)
        self.adds_positions = isinstance(self.positional, AddPositions)  # has a pos_embed site
        self.hooks: dict[str, list[Hook]] = {}  # sites embed, pos_embed, embed_norm.* (attnlab.nn.hooks)

    def forward(
        self, tokens: Tensor, offset: int = 0, token_types: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """``positions`` (B, T): explicit positions (randomized positions); default offset, offset + 1, ..."""
        _check_ids(tokens, self.token.num_embeddings)
        embedded = self.token(tokens)
        token = embedded * _in_dtype(self.scale, embedded.dtype)  # s E[x_i]
        if not self.hooks:
            return self.dropout(self.norm(self.token_type(self.positional(token, offset, positions), token_types)))
        x = self.token_type(self._hooked(token, offset, positions), token_types)
        return self.dropout(NORMS["layer"].run(self.norm, x, self.hooks, EMBED_NORM_POINTS) if self.norm_points else x)

    def _hooked(self, token: Tensor, offset: int, positions: Tensor | None) -> Tensor:
        """f(s E[x_i], p_i) with the ``embed`` and ``pos_embed`` sites (the latter when p_i is added)."""
        token = run_hooks(self.hooks, "embed", token)
        if "pos_embed" not in self.hooks or not self.adds_positions:
            return self.positional(token, offset, positions)
        added = self.positional.added(token, offset, positions).expand_as(token)  # (B, T, d_model)
        return token + run_hooks(self.hooks, "pos_embed", added)


EMBED_NORM_POINTS = ("embed_norm.scale", "embed_norm.normalized")
"""The named sites of the embedding's LayerNorm (BERT), ``STACK.embed_norm.*``."""


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (the multiplier Hugging Face's ``torch.tensor(value, dtype=dtype)`` is)."""
    return float(torch.tensor(value, dtype=dtype))
