"""Add & Norm, and the encoder and decoder layers built from it.

Add & Norm (Li's slides; Agarwal Def. 6.3), with LayerNorm(a; g, b) = g * (a - mu) / sigma + b
(Agarwal Def. 6.1, applied row-wise, Remark 6.2), or RMSNorm in Llama-family models
(:mod:`attnlab.nn.normalization`):

* post-LN, as in the paper:  LayerNorm(x + Sublayer(x))
* pre-LN option:             x + Sublayer(LayerNorm(x))     (needs a final LayerNorm after the stack)

An encoder layer is self-attention then FFN, each wrapped in Add & Norm (Vaswani §3.1; Agarwal §3).
A decoder layer is masked self-attention, then encoder-decoder attention, then FFN (Vaswani §3.1;
Agarwal §5.2-5.3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn

from attnlab.kernels import Dropout, dropout
from attnlab.nn.feed_forward import PositionwiseFeedForward
from attnlab.nn.hooks import Hook, run_hooks
from attnlab.nn.multi_head import KVCache, MultiHeadAttention
from attnlab.nn.normalization import NORMS, make_norm

__all__ = ["AddNorm", "EncoderLayer", "DecoderLayer", "DecoderLayerCache"]


class AddNorm(nn.Module):
    """Residual connection and LayerNorm around a sublayer (Agarwal Def. 6.3).

    Args:
        d_model: width normalised over.
        norm_first: False for the paper's post-LN, LayerNorm(x + Dropout(Sublayer(x))); True for
            pre-LN, x + Dropout(Sublayer(LayerNorm(x))).
        eps: added to the variance inside LayerNorm.
        dropout: dropout on the sublayer's output during training (Vaswani §5.4).
        norm: ``layer`` (LayerNorm) or ``rms`` (RMSNorm), a name in :data:`attnlab.nn.normalization.NORMS`.

    Shape:
        x: (B, T, d_model); ``sublayer`` maps (B, T, d_model) -> (B, T, d_model).
    """

    def __init__(
        self, d_model: int, *, norm_first: bool = False, eps: float = 1e-5, dropout: float = 0.0, norm: str = "layer"
    ) -> None:
        super().__init__()
        self.norm = make_norm(norm, d_model, eps)  # gain g = norm.weight (and LayerNorm's bias b)
        self._normalize = NORMS[norm].apply
        self.dropout = Dropout(dropout)
        self.norm_first = norm_first
        self._combine = self._pre_norm if norm_first else self._post_norm

    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self._combine(x, sublayer)

    def _post_norm(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        return self._normalize(self.norm, x + dropout(sublayer(x), self.dropout.p, self.training))

    def _pre_norm(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        # Functional, on the sub-module's parameters: a decoding step runs nine Add & Norms in a
        # 3-layer decoder, and on a single row a sub-module call costs more than the kernel.
        return x + dropout(sublayer(self._normalize(self.norm, x)), self.dropout.p, self.training)

    def extra_repr(self) -> str:
        return f"norm_first={self.norm_first}, norm={type(self.norm).__name__}"


class EncoderLayer(nn.Module):
    """x -> AddNorm(self-attention) -> AddNorm(FFN)  (Vaswani §3.1; Agarwal §3, §5.1).

    With ``causal=True`` in :meth:`forward` this is also the layer of a decoder-only model.

    Args:
        self_attn: the layer's multi-head self-attention.
        feed_forward: the layer's position-wise FFN.
        norm_first, eps, dropout, norm: as for :class:`AddNorm`.

    Shape:
        x: (B, T, d_model) -> (B, T, d_model);  mask broadcastable to (B, H, T, T_k).
    """

    def __init__(
        self,
        self_attn: MultiHeadAttention,
        feed_forward: PositionwiseFeedForward,
        *,
        norm_first: bool = False,
        eps: float = 1e-5,
        dropout: float = 0.0,
        norm: str = "layer",
    ) -> None:
        super().__init__()
        d_model = self_attn.d_model
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.attn_norm = AddNorm(d_model, norm_first=norm_first, eps=eps, dropout=dropout, norm=norm)
        self.ffn_norm = AddNorm(d_model, norm_first=norm_first, eps=eps, dropout=dropout, norm=norm)
        self.hooks: dict[str, list[Hook]] = {}  # sites resid_pre, resid_mid, resid_post (attnlab.nn.hooks)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
    ) -> Tensor:
        hooks = self.hooks
        if hooks:
            x = run_hooks(hooks, "resid_pre", x)
        x = self.attn_norm(
            x,
            lambda y: self.self_attn(
                y, mask=mask, causal=causal, cache=cache, positions=positions, key_positions=key_positions
            ),
        )
        if hooks:
            x = run_hooks(hooks, "resid_mid", x)
        x = self.ffn_norm(x, self.feed_forward)
        return x if not hooks else run_hooks(hooks, "resid_post", x)


@dataclass
class DecoderLayerCache:
    """The KV caches of one decoder layer: its self-attention and its encoder-decoder attention."""

    self_attn: KVCache = field(default_factory=KVCache)
    cross_attn: KVCache = field(default_factory=KVCache)

    def reorder(self, index: Tensor) -> None:
        self.self_attn.reorder(index)
        self.cross_attn.reorder(index)


class DecoderLayer(nn.Module):
    """y -> AddNorm(masked self-attention) -> AddNorm(encoder-decoder attention) -> AddNorm(FFN).

    (Vaswani §3.1 and §3.2.3; Agarwal §5.2-5.3.) The self-attention is causal: position i attends
    to positions <= i. The encoder-decoder attention takes its queries from the decoder and its
    keys and values from the encoder output ``memory``.

    Shape:
        y: (B, T_tgt, d_model);  memory: (B, T_src, d_model);
        memory_mask broadcastable to (B, H, T_tgt, T_src);  returns (B, T_tgt, d_model).
    """

    def __init__(
        self,
        self_attn: MultiHeadAttention,
        cross_attn: MultiHeadAttention,
        feed_forward: PositionwiseFeedForward,
        *,
        norm_first: bool = False,
        eps: float = 1e-5,
        dropout: float = 0.0,
        norm: str = "layer",
    ) -> None:
        super().__init__()
        d_model = self_attn.d_model
        self.self_attn = self_attn
        self.cross_attn = cross_attn
        self.feed_forward = feed_forward
        self.self_attn_norm = AddNorm(d_model, norm_first=norm_first, eps=eps, dropout=dropout, norm=norm)
        self.cross_attn_norm = AddNorm(d_model, norm_first=norm_first, eps=eps, dropout=dropout, norm=norm)
        self.ffn_norm = AddNorm(d_model, norm_first=norm_first, eps=eps, dropout=dropout, norm=norm)
        self.hooks: dict[str, list[Hook]] = {}  # resid_pre, resid_mid, resid_cross, resid_post (attnlab.nn.hooks)

    def forward(
        self,
        y: Tensor,
        memory: Tensor,
        *,
        self_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        cache: DecoderLayerCache | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
    ) -> Tensor:
        self_cache = None if cache is None else cache.self_attn
        cross_cache = None if cache is None else cache.cross_attn
        hooks = self.hooks
        if hooks:
            y = run_hooks(hooks, "resid_pre", y)
        y = self.self_attn_norm(
            y,
            lambda z: self.self_attn(
                z, mask=self_mask, causal=True, cache=self_cache, positions=positions, key_positions=key_positions
            ),
        )
        if hooks:
            y = run_hooks(hooks, "resid_mid", y)
        y = self.cross_attn_norm(y, lambda z: self.cross_attn(z, memory, mask=memory_mask, cache=cross_cache))
        if hooks:
            y = run_hooks(hooks, "resid_cross", y)
        y = self.ffn_norm(y, self.feed_forward)
        return y if not hooks else run_hooks(hooks, "resid_post", y)
