"""The stacks: :class:`Encoder` (embedding, then N encoder layers; causal, a decoder-only model's
decoder) and :class:`Decoder` (embedding, then N decoder layers with cross-attention), each ending
with its final norm (pre-norm placements), built from the config's attention and feed-forward.

Vaswani §3.1; Agarwal §3, §5.1-5.3. A stack's output is its named site ``STACK.final_norm``
(:mod:`attnlab.nn.hooks`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attnlab.nn.config import TransformerConfig
from attnlab.nn.decoding import DecodingState, EncodedSource
from attnlab.nn.embedding import InputEmbedding
from attnlab.nn.feed_forward import PositionwiseFeedForward
from attnlab.nn.hooks import Hook, run_hooks
from attnlab.nn.layers import PLACEMENTS, DecoderLayer, EncoderLayer
from attnlab.nn.masks import combine_masks, padding_mask, sliding_window_mask
from attnlab.nn.model_configs import EncoderDecoderConfig
from attnlab.nn.multi_head import MultiHeadAttention
from attnlab.nn.normalization import NORMS, Norm, make_norm
from attnlab.nn.position_bias import POSITION_BIASES
from attnlab.nn.token_positions import PositionPlacer

__all__ = ["Encoder", "Decoder", "FINAL_NORM_POINTS"]


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


def _final_norm(config: TransformerConfig) -> tuple[nn.Module, Norm | None]:
    """Stacks of pre-LN (sandwich, output) layers end with a norm (the module and its kind); post-LN
    ones are already normalised (the identity, no kind)."""
    if not PLACEMENTS[config.placement].final_norm:
        return nn.Identity(), None
    return make_norm(config.norm, config.d_model, config.layer_norm_eps), NORMS[config.norm]


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
