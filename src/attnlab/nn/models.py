"""The four models: EncoderDecoder, EncoderClassifier, DecoderOnly and EncoderOnly.

Each maps token ids to logits and nothing else: no loss, no tokenizer, no files. Each names its
stacks (:meth:`TransformerModel.site_stacks`), from which :mod:`attnlab.nn.hooks` names every site
that is read or changed: caching, editing, capture and the head mask are all hooks on those sites.

* :class:`EncoderDecoder`: p(y_{1:L} | x_{1:T}) = prod_l p(y_l | y_{<l}, z_{1:T}) (Li's slides,
  "Transformer Architecture"; Vaswani §3.1). Training feeds the target shifted right (Agarwal §5.2).
* :class:`EncoderClassifier`: language recognition; the label is read from the last activation
  y_n^(L), after the end-of-sequence symbol (Hahn §3, "Formalizing Language Recognition").
* :class:`DecoderOnly`: a causal language model.
* :class:`EncoderOnly`: the last hidden states of an encoder (BERT-family sentence encoders).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from attnlab.kernels import Dropout, LinearKernel, linear_kernel
from attnlab.nn.config import (
    DecoderOnlyConfig,
    EncoderClassifierConfig,
    EncoderDecoderConfig,
    EncoderOnlyConfig,
    TransformerConfig,
)
from attnlab.nn.feed_forward import PositionwiseFeedForward
from attnlab.nn.head_masks import head_mask_shapes
from attnlab.nn.hooks import Hook, Site, attention_sites, run_hooks
from attnlab.nn.layers import PLACEMENTS, DecoderLayer, DecoderLayerCache, EncoderLayer
from attnlab.nn.masks import combine_masks, padding_mask, sliding_window_mask
from attnlab.nn.multi_head import KVCache, MultiHeadAttention
from attnlab.nn.normalization import NORMS, Norm, make_norm
from attnlab.nn.position_bias import POSITION_BIASES
from attnlab.nn.positional import AddPositions, make_positional, randomized_positions
from attnlab.nn.rotary import positions_of_tokens
from attnlab.nn.scores import soft_cap

__all__ = [
    "TransformerModel",
    "InputEmbedding",
    "OutputLayer",
    "Encoder",
    "Decoder",
    "EncodedSource",
    "DecodingState",
    "EncoderDecoder",
    "EncoderClassifier",
    "DecoderOnly",
    "EncoderOnly",
    "TokenTypes",
    "POOLINGS",
    "MODELS",
    "build_model_to_load",
    "build_model",
    "drawing_positions",
    "planned_positions",
    "mean_pool",
    "optional_state_keys",
]


class TransformerModel(nn.Module):
    """Base class: a model that names its stacks, whence its named sites (:mod:`attnlab.nn.hooks`)."""

    config: TransformerConfig
    has_logits_site: bool = True
    """Whether the model's output is the named site ``logits`` (not for an encoder-only model)."""
    logits_position_axis: int | None = 1
    """The positions' axis of ``logits``; None for one output per sequence (a classifier)."""
    has_pooled_site: bool = False
    """Whether the model pools its stack's output into the named site ``pooled`` (a classifier)."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: dict[str, list[Hook]] = {}  # the sites logits and pooled (attnlab.nn.hooks)

    def attention_sites(self) -> list[Site]:
        """The ``z`` site of every attention module (its kind, layer and module), in forward order."""
        return attention_sites(self)

    def site_stacks(self) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
        """``encoder`` / ``decoder`` -> (the stack, the head-mask kinds of its self-attention and,
        for decoder layers of an encoder-decoder, its cross-attention)."""
        raise NotImplementedError

    def example_inputs(self, length: int) -> tuple[Tensor, ...]:
        """A forward pass's positional inputs for one row of ``length`` real tokens (named-site
        shapes, :func:`attnlab.nn.hooks.site_shapes`)."""
        token = 1 if self.config.pad_id != 1 else 2
        return (torch.full((1, length), token, device=next(self.parameters()).device),)

    def _logits(self, logits: Tensor) -> Tensor:
        return logits if not self.hooks else run_hooks(self.hooks, "logits", logits)

    @property
    def norm_form(self) -> str:
        """The form of the model's norms as direct attribution freezes them: ``config.norm``."""
        return self.config.norm

    def head_mask_shapes(self) -> dict[str, tuple[int, int]]:
        """kind -> (layers, heads) for every attention kind of the model
        (:func:`attnlab.nn.head_masks.head_mask_shapes`)."""
        return head_mask_shapes(self)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


# ---- building blocks ---------------------------------------------------------------------------


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

FINAL_NORM_POINTS = ("final_norm.scale", "final_norm.normalized")
"""The named sites of a stack's final norm, ``STACK.final_norm.*`` (the stack's output is ``STACK.final_norm``)."""


def _normed_output(stack: nn.Module, x: Tensor) -> Tensor:
    """A stack's output: its final norm of ``x`` (through the norm's sites when hooked), then the
    ``final_norm`` site."""
    if not stack.hooks:
        return stack.final_norm(x)
    if stack.final_norm_points:
        x = stack.final_norm_kind.run(stack.final_norm, x, stack.hooks, FINAL_NORM_POINTS)
    else:
        x = stack.final_norm(x)
    return run_hooks(stack.hooks, "final_norm", x)


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """``value`` rounded to ``dtype`` (the multiplier Hugging Face's ``torch.tensor(value, dtype=dtype)`` is)."""
    return float(torch.tensor(value, dtype=dtype))


def _multi_head(config: TransformerConfig, kind: str, layer: int) -> MultiHeadAttention:
    # Sliding-window layers with their own rotary base (Gemma 3) take no frequency scaling.
    own_base = config.is_local_layer(layer) and config.local_rope_base is not None
    return MultiHeadAttention(
        config.d_model,
        config.heads_at(kind, layer),
        d_k=config.d_k,
        d_v=config.d_v,
        score=config.score,
        normalizer=config.normalizer,
        straight_through=config.straight_through,
        dropout=config.attention_dropout,
        bias=config.bias,
        qkv_bias=config.qkv_bias,
        # Grouped-query attention in self-attention; None: one key/value head per (unpruned) head.
        kv_heads=None if kind == "cross" or config.kv_index_at(kind, layer) is not None else config.kv_heads,
        kv_index=config.kv_index_at(kind, layer),  # what pruning left of grouped-query attention
        # Rotary positions rotate self-attention's queries and keys; cross-attention has none.
        rope_base=(config.local_rope_base if own_base else config.rope_base)
        if config.positional == "rope" and kind != "cross"
        else None,
        rotary_fraction=config.rotary_fraction,
        rope_scaling=None if own_base else config.rope_scaling,
        qk_norm=config.qk_norm,
        norm=config.norm,
        norm_eps=config.layer_norm_eps,
        # ALiBi and Shaw et al.'s relative positions bias self-attention's scores; not cross-attention's.
        position_bias=config.positional if config.positional in POSITION_BIASES and kind != "cross" else None,
        relative_clip=config.relative_clip,
        scale=config.query_scale,
        softcap=config.attention_softcap,
    )


def _feed_forward(config: TransformerConfig) -> PositionwiseFeedForward:
    return PositionwiseFeedForward(
        config.d_model,
        config.d_ff,
        activation=config.activation,
        dropout=config.activation_dropout,
        bias=config.bias,
    )


class OutputLayer(nn.Linear):
    """The last linear map, hidden states -> logits, through the GEMM kernel of the runtime setting.

    A ``torch.nn.Linear`` (the same parameters and state-dict keys) whose forward is the kernel
    ``ATTNLAB_LINEAR`` names (:func:`attnlab.kernels.linear_kernel`).

    Shape:
        x: (..., d_model) -> (..., out_features).
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._linear: LinearKernel = linear_kernel()

    def forward(self, x: Tensor) -> Tensor:
        return self._linear(x, self.weight, self.bias)


def _final_norm(config: TransformerConfig) -> tuple[nn.Module, Norm | None]:
    """Stacks of pre-LN (sandwich, output) layers end with a norm (the module and its kind); post-LN
    ones are already normalised (the identity, no kind)."""
    if not PLACEMENTS[config.placement].final_norm:
        return nn.Identity(), None
    return make_norm(config.norm, config.d_model, config.layer_norm_eps), NORMS[config.norm]


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
    :attr:`DecodingState.positions`), so generation sees the training distribution of positions
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


def _key_padding(is_token: Tensor) -> Tensor | None:
    """The padding mask, or None when nothing is padded (which keeps SDPA's fastest path)."""
    return None if bool(is_token.all()) else padding_mask(is_token)


def _one_mask(mask: Tensor | None, t_q: int, t_k: int, device: torch.device) -> tuple[Tensor | None, ...]:
    """No sliding-window layers: every layer takes the same mask."""
    return mask, mask


class Encoder(nn.Module):
    """Embedding, then N encoder layers (Vaswani §3.1; Agarwal §3, §5.1).

    With ``causal=True`` every layer's self-attention is masked, which makes this the decoder of a
    decoder-only model (:class:`DecoderOnly`'s ``decoder``): a decoder without cross-attention is a
    causal encoder stack. The layers that ``sliding_window`` / ``sliding_layers`` name
    (:attr:`local_layers`) attend locally: their mask adds :func:`attnlab.nn.masks.sliding_window_mask`
    over the key columns (a KV cache's included), built once per forward pass.

    Args:
        config: model options.
        vocab_size: token vocabulary size.
        causal: mask future positions in self-attention.
        kind: the attention kind of its sites (``encoder_self`` or ``self``).

    Shape:
        tokens: (B, T);  returns (B, T, d_model).
    """

    def __init__(
        self, config: TransformerConfig, *, vocab_size: int, causal: bool = False, kind: str = "encoder_self"
    ) -> None:
        super().__init__()
        self.pad_id, self.causal, self.kind = config.pad_id, causal, kind
        self.embedding = InputEmbedding(vocab_size, config)
        self.layers = nn.ModuleList(
            EncoderLayer(
                _multi_head(config, kind, index),
                _feed_forward(config),
                placement=config.placement,
                eps=config.layer_norm_eps,
                dropout=config.dropout,
                norm=config.norm,
                parallel=config.parallel_residual,
            )
            for index in range(config.layers)
        )
        self.final_norm, self.final_norm_kind = _final_norm(config)
        self.final_norm_points = FINAL_NORM_POINTS if self.final_norm_kind is not None else ()  # named sites
        self._place = PositionPlacer(config)
        # Chosen once: sliding-window layers get the window's mask as well, or every layer one mask.
        self.local_layers = [config.is_local_layer(index) for index in range(config.layers)]
        self.sliding_window = config.sliding_window
        self._layer_masks = self._with_window if any(self.local_layers) else _one_mask
        self.hooks: dict[str, list[Hook]] = {}  # the site final_norm (attnlab.nn.hooks)

    def _with_window(self, mask: Tensor | None, t_q: int, t_k: int, device: torch.device) -> tuple[Tensor | None, ...]:
        """(the global layers' mask, the sliding-window layers'), built once per forward pass."""
        window = sliding_window_mask(t_q, self.sliding_window, t_k, device=device)  # type: ignore[arg-type]
        return mask, combine_masks(mask, window)

    def forward(
        self,
        tokens: Tensor,
        *,
        state: DecodingState | None = None,
        token_types: Tensor | None = None,
        is_token: Tensor | None = None,
    ) -> Tensor:
        """With ``state``, ``tokens`` holds only the new positions; keys come from the caches.
        ``is_token`` (B, T) says which positions are real tokens; default ``tokens != pad_id``."""
        offset = 0 if state is None else len(state)
        is_token = tokens != self.pad_id if is_token is None else is_token
        keys_are_tokens = is_token if state is None else state.advance(is_token)  # (B, T_k)
        masks = self._layer_masks(
            _key_padding(keys_are_tokens), tokens.shape[1], keys_are_tokens.shape[1], tokens.device
        )
        place = self._place(
            keys_are_tokens, tokens.shape[1], training=self.training, cached=state is not None, tokens=tokens
        )
        x = self.embedding(tokens, offset, token_types, place.embedding)
        for index, layer in enumerate(self.layers):
            x = layer(
                x,
                mask=masks[self.local_layers[index]],
                causal=self.causal,
                cache=None if state is None else state.layers[index],
                positions=place.queries,
                key_positions=place.keys,
            )
        return _normed_output(self, x)


@dataclass
class DecodingState:
    """What a model keeps between decoding steps: one KV cache per layer, and which keys so far
    are real tokens (so a padding token fed at step t stays masked at every later step).

    Attributes:
        layers: a :class:`KVCache` (decoder-only) or :class:`DecoderLayerCache` per layer.
        is_token: (B, T_k) bool over all keys seen so far, or None before the first step.
        positions: (B, T_p) positions planned for the tokens to come (randomized-position evaluation
            of a generating decoder, :func:`planned_positions`), or None for 0, 1, ...
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


class Decoder(nn.Module):
    """Embedding, then N decoder layers (Vaswani §3.1; Agarwal §5.2-5.3).

    Shape:
        tokens: (B, T_tgt) (already shifted right);  returns (B, T_tgt, d_model).
    """

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.pad_id = config.pad_id
        self.embedding = InputEmbedding(config.target_vocab_size, config)
        self.layers = nn.ModuleList(
            DecoderLayer(
                _multi_head(config, "decoder_self", index),
                _multi_head(config, "cross", index),
                _feed_forward(config),
                placement=config.placement,
                eps=config.layer_norm_eps,
                dropout=config.dropout,
                norm=config.norm,
            )
            for index in range(config.decoder_depth)
        )
        self.final_norm, self.final_norm_kind = _final_norm(config)
        self.final_norm_points = FINAL_NORM_POINTS if self.final_norm_kind is not None else ()  # named sites
        self._place = PositionPlacer(config)
        self.hooks: dict[str, list[Hook]] = {}  # the site final_norm (attnlab.nn.hooks)

    def forward(
        self,
        tokens: Tensor,
        memory: EncodedSource,
        *,
        state: DecodingState | None = None,
    ) -> Tensor:
        """With ``state``, ``tokens`` holds only the new positions."""
        offset = 0 if state is None else len(state)
        is_token = tokens != self.pad_id
        keys_are_tokens = is_token if state is None else state.advance(is_token)  # (B, T_k)
        self_mask = _key_padding(keys_are_tokens)
        place = self._place(
            keys_are_tokens,
            tokens.shape[1],
            training=self.training,
            cached=state is not None,
            tokens=tokens,
            planned=None if state is None else state.positions,
        )
        memory_mask = _key_padding(memory.is_token)
        y = self.embedding(tokens, offset, None, place.embedding)
        for index, layer in enumerate(self.layers):
            y = layer(
                y,
                memory.states,
                self_mask=self_mask,
                memory_mask=memory_mask,
                cache=None if state is None else state.layers[index],
                positions=place.queries,
                key_positions=place.keys,
            )
        return _normed_output(self, y)


# ---- the three models ----------------------------------------------------------------------------


class EncoderDecoder(TransformerModel):
    """The Transformer of Vaswani §3: encoder, decoder, and a linear map to target-token logits.

    Attention kinds: ``encoder_self``, ``decoder_self``, ``cross``.

    Shape:
        src: (B, T_src);  tgt_in: (B, T_tgt), the target shifted right (BOS first);
        returns logits (B, T_tgt, tgt_vocab).
    """

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config, vocab_size=config.vocab_size)
        self.decoder = Decoder(config)
        self.generator = OutputLayer(config.d_model, config.target_vocab_size, bias=config.bias)
        if config.tie_embeddings:
            self.generator.weight = self.decoder.embedding.token.weight

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src))

    def encode(self, src: Tensor) -> EncodedSource:
        return EncodedSource(self.encoder(src), src != self.config.pad_id)

    def decode(
        self,
        tgt_in: Tensor,
        memory: EncodedSource,
        *,
        state: DecodingState | None = None,
    ) -> Tensor:
        """Logits for ``tgt_in``; with ``state`` (from :meth:`new_state`), only the new positions."""
        return self._logits(self.generator(self.decoder(tgt_in, memory, state=state)))

    def new_state(self) -> DecodingState:
        return DecodingState([DecoderLayerCache() for _ in self.decoder.layers])

    def site_stacks(self) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
        return {"encoder": (self.encoder, ("encoder_self",)), "decoder": (self.decoder, ("decoder_self", "cross"))}

    def example_inputs(self, length: int) -> tuple[Tensor, ...]:
        (tokens,) = super().example_inputs(length)
        return tokens, tokens  # a source and a target of the same length


def _pool_eos(hidden: Tensor, is_token: Tensor) -> Tensor:
    """y_n^(L): the last real position, which holds the end-of-sequence symbol (Hahn §3)."""
    length = is_token.shape[1]
    last = length - 1 - is_token.flip(1).to(torch.int64).argmax(dim=1)  # (B,) index of the last True
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, d_model)


def _pool_first(hidden: Tensor, is_token: Tensor) -> Tensor:
    return hidden[:, 0]


def _pool_mean(hidden: Tensor, is_token: Tensor) -> Tensor:
    weights = is_token.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
    return (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)


POOLINGS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "eos": _pool_eos,
    "first": _pool_first,
    "mean": _pool_mean,
}
"""Registry of readouts: (hidden (B, T, d), is_token (B, T)) -> (B, d)."""


class EncoderClassifier(TransformerModel):
    """An encoder whose label is read at one position: language recognition (Hahn §3).

    "A softmax probability vector is computed for this label from the last activation y_n^(L),
    obtained after reading the end-of-sequence symbol." With ``pooling='eos'`` that position is the
    last non-padding one, so padding never changes the prediction.

    Attention kind: ``self``.

    Shape:
        tokens: (B, T), each row ending with EOS before any padding;  returns logits (B, num_classes).
    """

    logits_position_axis = None  # one row of class logits per sequence
    has_pooled_site = True  # the pooled state the classifier reads

    def __init__(self, config: EncoderClassifierConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config, vocab_size=config.vocab_size, kind="self")
        self.pool = POOLINGS[config.pooling]
        self.classifier = OutputLayer(config.d_model, config.num_classes, bias=config.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        pooled = self.pool(self.encoder(tokens), tokens != self.config.pad_id)  # (B, d_model)
        return self._logits(self.classifier(pooled if not self.hooks else run_hooks(self.hooks, "pooled", pooled)))

    def site_stacks(self) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
        return {"encoder": (self.encoder, ("self",))}


def _identity(x: Tensor) -> Tensor:
    return x


class DecoderOnly(TransformerModel):
    """A causal language model: p(x_t | x_{<t}) from masked self-attention layers.

    With ``final_softcap`` c the logits are c tanh(logits / c) (Gemma 2), the ``logits`` site
    after the cap.

    Attention kind: ``self``.

    Shape:
        tokens: (B, T);  is_token: (B, T) bool or None;  returns logits (B, T, vocab). With
        ``state`` (from :meth:`new_state`), ``tokens`` holds only the new positions.
    """

    def __init__(self, config: DecoderOnlyConfig) -> None:
        super().__init__()
        self.config = config
        self.decoder = Encoder(config, vocab_size=config.vocab_size, causal=True, kind="self")
        self.lm_head = OutputLayer(config.d_model, config.vocab_size, bias=config.bias)
        if config.tie_embeddings:
            self.lm_head.weight = self.decoder.embedding.token.weight
        # Chosen once: soft-capped logits (Gemma 2), or the output layer's as they are.
        self._cap = _identity if config.final_softcap is None else partial(soft_cap, cap=config.final_softcap)

    def forward(
        self,
        tokens: Tensor,
        *,
        state: DecodingState | None = None,
        is_token: Tensor | None = None,
    ) -> Tensor:
        """``is_token`` (B, T): which positions are real tokens, for a model whose padding id is
        also a real token (a pretrained LM's); default ``tokens != pad_id``."""
        hidden = self.decoder(tokens, state=state, is_token=is_token)
        return self._logits(self._cap(self.lm_head(hidden)))

    def new_state(self) -> DecodingState:
        return DecodingState([KVCache() for _ in self.decoder.layers])

    def site_stacks(self) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
        return {"decoder": (self.decoder, ("self",))}


class EncoderOnly(TransformerModel):
    """An encoder and nothing on top: the last hidden states y^(L), as BERT's ``BertModel`` gives
    them (without its pooler). Sentence encoders average them over the real tokens
    (:func:`mean_pool`).

    Attention kind: ``self``.

    Shape:
        tokens: (B, T);  token_types: (B, T) or None (all type 0);  returns (B, T, d_model).
    """

    has_logits_site = False  # its output is encoder.final_norm

    def __init__(self, config: EncoderOnlyConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = Encoder(config, vocab_size=config.vocab_size, kind="self")

    def forward(self, tokens: Tensor, *, token_types: Tensor | None = None) -> Tensor:
        return self.encoder(tokens, token_types=token_types)

    def site_stacks(self) -> dict[str, tuple[nn.Module, tuple[str, ...]]]:
        return {"encoder": (self.encoder, ("self",))}


def mean_pool(hidden: Tensor, is_token: Tensor) -> Tensor:
    """The mean of the hidden states over real tokens: sum_t m_t y_t / sum_t m_t.

    Shape:
        hidden: (B, T, d);  is_token: (B, T) bool;  returns (B, d).
    """
    return _pool_mean(hidden, is_token)


MODELS: dict[str, tuple[type[TransformerConfig], type[TransformerModel]]] = {
    "encoder_decoder": (EncoderDecoderConfig, EncoderDecoder),
    "encoder_classifier": (EncoderClassifierConfig, EncoderClassifier),
    "decoder_only": (DecoderOnlyConfig, DecoderOnly),
    "encoder": (EncoderOnlyConfig, EncoderOnly),
}
"""Registry of models: kind -> (config class, model class)."""


def build_model(config: TransformerConfig) -> TransformerModel:
    """The model for ``config`` (its class decides which)."""
    for config_cls, model_cls in MODELS.values():
        if type(config) is config_cls:
            return model_cls(config)  # type: ignore[call-arg]
    raise ValueError(f"no model for config class {type(config).__name__}; allowed kinds: {', '.join(MODELS)}")


def optional_state_keys(model: nn.Module) -> set[str]:
    """State-dict keys that weights saved by an older attnlab may lack (a module's ``optional_state``,
    e.g. :class:`attnlab.nn.positional.LearnedTable`'s ``trained_positions``): they load as their
    reset value when missing."""
    return {
        f"{name}.{key}" if name else key
        for name, module in model.named_modules()
        for key in getattr(module, "optional_state", ())
    }


def build_model_to_load(config: TransformerConfig) -> TransformerModel:
    """The model for ``config`` with its parameters allocated but not initialised: for loading
    saved weights by assignment (``attnlab.run.directory.load_tensors_into(..., assign=True)``), which puts
    a tensor in place of every parameter, so the model's weights are never held twice.

    Memory the allocator hands out is not resident until written, so skipping the random
    initialisation (``torch.nn.init`` and the in-place random fills it uses) leaves the
    parameters' memory untouched until the loaded tensors replace it. Buffers (rotary angles,
    sinusoidal tables) are computed as usual. Not the meta device: PyTorch's meta kernels import
    ``torch._dynamo`` (over a second and 75 MB).
    """
    with _WithoutInitialisation():
        return build_model(config)


class _WithoutInitialisation(TorchFunctionMode):
    """Inside it, ``torch.nn.init``'s functions and ``Tensor.uniform_`` / ``normal_`` leave their
    tensor as it is."""

    _SKIPPED = (torch.Tensor.uniform_, torch.Tensor.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__module__", None) == "torch.nn.init" or func in self._SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))
