"""Add & Norm, and the encoder and decoder layers built from it.

Add & Norm (Li's slides; Agarwal Def. 6.3), with LayerNorm(a; g, b) = g * (a - mu) / sigma + b
(Agarwal Def. 6.1, applied row-wise, Remark 6.2), or RMSNorm in Llama-family models
(:mod:`attnlab.nn.normalization`). Where the norms sit is the placement, a name in
:data:`PLACEMENTS`:

* ``post``, as in the paper:  Norm(x + Sublayer(x))
* ``pre``:                    x + Sublayer(Norm(x))                   (GPT-2, Llama)
* ``sandwich``:               x + Norm_post(Sublayer(Norm(x)))        (Gemma 2 and 3)
* ``output``:                 x + Norm(Sublayer(x))                   (OLMo 2)

All but ``post`` add a residual branch to x, and their stacks end with a final norm.

An encoder layer is self-attention then FFN, each wrapped in Add & Norm (Vaswani §3.1; Agarwal §3);
with parallel residuals (GPT-J, GPT-NeoX) both branches read the layer's input,
x + Attn(Norm_1(x)) + FFN(Norm_2(x)). A decoder layer is masked self-attention, then
encoder-decoder attention, then FFN (Vaswani §3.1; Agarwal §5.2-5.3).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor, nn

from attnlab.kernels import Dropout, dropout
from attnlab.nn.feed_forward import PositionwiseFeedForward
from attnlab.nn.hooks import Hook, run_hooks
from attnlab.nn.kv_cache import KVCache
from attnlab.nn.multi_head import MultiHeadAttention
from attnlab.nn.normalization import NORMS, make_norm

__all__ = ["AddNorm", "EncoderLayer", "DecoderLayer", "DecoderLayerCache", "PLACEMENTS", "Placement"]

Sublayer = Callable[[Tensor], Tensor]


def _post(add_norm: AddNorm, x: Tensor, sublayer: Sublayer) -> Tensor:
    """Norm(x + Dropout(Sublayer(x))): the paper's post-LN."""
    return add_norm.normed(x + dropout(sublayer(x), add_norm.dropout.p, add_norm.training))


def _pre(add_norm: AddNorm, x: Tensor, sublayer: Sublayer) -> Tensor:
    """Dropout(Sublayer(Norm(x))), the branch of pre-LN."""
    # Functional, on the sub-module's parameters: a decoding step runs nine Add & Norms in a
    # 3-layer decoder, and on a single row a sub-module call costs more than the kernel.
    return dropout(sublayer(add_norm.normed(x)), add_norm.dropout.p, add_norm.training)


def _sandwich(add_norm: AddNorm, x: Tensor, sublayer: Sublayer) -> Tensor:
    """Dropout(Norm_post(Sublayer(Norm(x)))), Gemma 2's branch."""
    branch = add_norm.post_normed(sublayer(add_norm.normed(x)))
    return dropout(branch, add_norm.dropout.p, add_norm.training)


def _output(add_norm: AddNorm, x: Tensor, sublayer: Sublayer) -> Tensor:
    """Dropout(Norm(Sublayer(x))), OLMo 2's branch."""
    return dropout(add_norm.normed(sublayer(x)), add_norm.dropout.p, add_norm.training)


@dataclass(frozen=True)
class Placement:
    """Where a sub-layer's norms sit.

    Attributes:
        branch: ``(add_norm, x, sublayer) -> b``, the residual branch, the layer's output being
            x + b; None where the norm is applied after the sum (``post``), ``combine`` then.
        norms: the number of norms around each sub-layer (``sandwich``: 2).
        combine: ``(add_norm, x, sublayer) -> output`` where there is no branch.
        norm_first: whether the (first) norm runs before the sub-layer (``pre``, ``sandwich``) or
            after it (``post``, ``output``): the order of the named sites.
    """

    branch: Callable[[AddNorm, Tensor, Sublayer], Tensor] | None
    norms: int = 1
    combine: Callable[[AddNorm, Tensor, Sublayer], Tensor] | None = None
    norm_first: bool = True

    @property
    def final_norm(self) -> bool:
        """Whether a stack of such layers ends with a norm: every placement with a residual branch."""
        return self.branch is not None


PLACEMENTS: dict[str, Placement] = {
    "post": Placement(None, combine=_post, norm_first=False),
    "pre": Placement(_pre),
    "sandwich": Placement(_sandwich, norms=2),
    "output": Placement(_output, norm_first=False),
}
"""Registry of norm placements: name -> :class:`Placement` (see the module docstring)."""


class AddNorm(nn.Module):
    """Residual connection and a norm around a sublayer (Agarwal Def. 6.3), the norm placed as
    :data:`PLACEMENTS` says.

    Args:
        d_model: width normalised over.
        placement: ``post`` (the paper's Norm(x + Dropout(Sublayer(x)))), ``pre``
            (x + Dropout(Sublayer(Norm(x)))), ``sandwich`` or ``output``.
        eps: added to the variance inside the norm.
        dropout: dropout on the sublayer's output during training (Vaswani §5.4).
        norm: ``layer`` (LayerNorm), ``rms`` (RMSNorm) or ``rms_one_plus``, a name in
            :data:`attnlab.nn.normalization.NORMS`.

    Attributes:
        norm: the norm (before the sublayer, or after the sum for ``post``, or after the sublayer
            for ``output``).
        post_norm: ``sandwich`` only: the norm of the sublayer's output.
        hooks: point -> hooks of its named sites ``scale`` and ``normalized`` (the norm's parts,
            :class:`attnlab.nn.normalization.Norm`), and ``post_scale``, ``post_normalized``
            (``sandwich``'s post norm).
        site_points: (the points computed before the sublayer, those after it).

    Shape:
        x: (B, T, d_model); ``sublayer`` maps (B, T, d_model) -> (B, T, d_model).
    """

    def __init__(
        self, d_model: int, *, placement: str = "post", eps: float = 1e-5, dropout: float = 0.0, norm: str = "layer"
    ) -> None:
        super().__init__()
        if placement not in PLACEMENTS:
            raise ValueError(f"norm_placement: unknown {placement!r}; allowed: {', '.join(sorted(PLACEMENTS))}")
        chosen = PLACEMENTS[placement]
        self.norm = make_norm(norm, d_model, eps)  # gain g = norm.weight (and LayerNorm's bias b)
        if chosen.norms == 2:
            self.post_norm = make_norm(norm, d_model, eps)
        self.norm_kind = NORMS[norm]
        self.dropout = Dropout(dropout)
        self.placement = placement
        self._branch = chosen.branch
        self._combine = chosen.combine if chosen.branch is None else _add_branch
        own, post = ("scale", "normalized"), ("post_scale", "post_normalized")
        after = post if chosen.norms == 2 else () if chosen.norm_first else own
        self.site_points = (own if chosen.norm_first else (), after)
        self.hooks: dict[str, list[Hook]] = {}  # sites scale, normalized, post_scale, post_normalized

    def forward(self, x: Tensor, sublayer: Sublayer) -> Tensor:
        return self._combine(self, x, sublayer)

    def normed(self, x: Tensor) -> Tensor:
        """Norm(x), through the ``scale`` and ``normalized`` sites when they are hooked."""
        return self.norm_kind.apply(self.norm, x) if not self.hooks else self.norm_kind.run(self.norm, x, self.hooks)

    def post_normed(self, x: Tensor) -> Tensor:
        """Norm_post(x) (``sandwich``), through the ``post_scale`` and ``post_normalized`` sites."""
        if not self.hooks:
            return self.norm_kind.apply(self.post_norm, x)
        return self.norm_kind.run(self.post_norm, x, self.hooks, ("post_scale", "post_normalized"))

    def branch(self, x: Tensor, sublayer: Sublayer) -> Tensor:
        """b in x + b: the sublayer's residual branch (placements other than ``post``)."""
        if self._branch is None:
            raise ValueError(f"norm_placement: {self.placement!r} has no residual branch")
        return self._branch(self, x, sublayer)

    def extra_repr(self) -> str:
        return f"placement={self.placement}, norm={type(self.norm).__name__}"


def _add_branch(add_norm: AddNorm, x: Tensor, sublayer: Sublayer) -> Tensor:
    return x + add_norm._branch(add_norm, x, sublayer)  # type: ignore[misc]


class EncoderLayer(nn.Module):
    """x -> AddNorm(self-attention) -> AddNorm(FFN)  (Vaswani §3.1; Agarwal §3, §5.1).

    With ``causal=True`` in :meth:`forward` this is also the layer of a decoder-only model. With
    ``parallel`` both sub-layers read the layer's input (GPT-J, GPT-NeoX):
    x + Attn(Norm_1(x)) + FFN(Norm_2(x)), the sites ``resid_mid`` = x + Attn(Norm_1(x)) and
    ``resid_post`` = resid_mid + FFN(Norm_2(x)) (an edit of ``resid_mid`` reaches the output, not
    the FFN's input).

    Args:
        self_attn: the layer's multi-head self-attention.
        feed_forward: the layer's position-wise FFN.
        placement, eps, dropout, norm: as for :class:`AddNorm`.
        parallel: attention and FFN side by side on the input (a placement with a residual branch).

    Shape:
        x: (B, T, d_model) -> (B, T, d_model);  mask broadcastable to (B, H, T, T_k).
    """

    def __init__(
        self,
        self_attn: MultiHeadAttention,
        feed_forward: PositionwiseFeedForward,
        *,
        placement: str = "post",
        eps: float = 1e-5,
        dropout: float = 0.0,
        norm: str = "layer",
        parallel: bool = False,
    ) -> None:
        super().__init__()
        d_model = self_attn.d_model
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.attn_norm = AddNorm(d_model, placement=placement, eps=eps, dropout=dropout, norm=norm)
        self.ffn_norm = AddNorm(d_model, placement=placement, eps=eps, dropout=dropout, norm=norm)
        if parallel and PLACEMENTS[placement].branch is None:
            raise ValueError(f"parallel_residual: needs a norm placement with a residual branch, not {placement!r}")
        self.parallel = parallel
        self._sublayers = self._side_by_side if parallel else self._one_after_the_other  # chosen once
        self.site_norms = (self.attn_norm,)  # the Add & Norm of each attention, for its named sites
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

        def attend(y: Tensor) -> Tensor:
            return self.self_attn(
                y, mask=mask, causal=causal, cache=cache, positions=positions, key_positions=key_positions
            )

        x = self._sublayers(x, attend)
        return x if not hooks else run_hooks(hooks, "resid_post", x)

    def _one_after_the_other(self, x: Tensor, attend: Sublayer) -> Tensor:
        x = self.attn_norm(x, attend)
        if self.hooks:
            x = run_hooks(self.hooks, "resid_mid", x)
        return self.ffn_norm(x, self.feed_forward)

    def _side_by_side(self, x: Tensor, attend: Sublayer) -> Tensor:
        middle = x + self.attn_norm.branch(x, attend)
        if self.hooks:
            middle = run_hooks(self.hooks, "resid_mid", middle)
        return middle + self.ffn_norm.branch(x, self.feed_forward)

    def extra_repr(self) -> str:
        return f"parallel={self.parallel}"


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

    Args:
        placement, eps, dropout, norm: as for :class:`AddNorm`.

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
        placement: str = "post",
        eps: float = 1e-5,
        dropout: float = 0.0,
        norm: str = "layer",
    ) -> None:
        super().__init__()
        d_model = self_attn.d_model
        self.self_attn = self_attn
        self.cross_attn = cross_attn
        self.feed_forward = feed_forward
        self.self_attn_norm = AddNorm(d_model, placement=placement, eps=eps, dropout=dropout, norm=norm)
        self.cross_attn_norm = AddNorm(d_model, placement=placement, eps=eps, dropout=dropout, norm=norm)
        self.ffn_norm = AddNorm(d_model, placement=placement, eps=eps, dropout=dropout, norm=norm)
        self.site_norms = (self.self_attn_norm, self.cross_attn_norm)  # of each attention, for its named sites
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
