"""Multi-head attention, with a head mask xi_h that works on the fused path.

Vaswani §3.2.2 writes it as a concatenation:

    MultiHead(Q, K, V) = Concat(head_1, ..., head_h) W^O,   head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)

Michel §2.2 Eq. (1) writes the same function as a sum over heads, with W^O split into per-head
blocks W_o^h of shape (d_model, d_v), and §2.3 adds a mask variable xi_h per head:

    MHAtt(x, q) = sum_h xi_h Att_h(x, q)          with Att_h = W_o^h head_h

Both are one line here: the heads are a real tensor axis (B, H, T_q, d_v), the site ``z``; the head
mask multiplies that tensor before W^O (a hook on ``z``, :func:`attnlab.nn.head_masks.masking_heads`),
and the concatenation + W^O is the sum over heads. Because xi_h scales the output of the attention
kernel rather than its weights, the fused SDPA kernel is used unchanged.

The same module serves the three uses of Vaswani §3.2.3 (Agarwal §5):

* encoder self-attention: ``mha(x)`` (Q = K = V = x; Agarwal Def. 5.1);
* masked decoder self-attention: ``mha(y, causal=True)`` (Agarwal Def. 5.3);
* encoder-decoder attention: ``mha(y, memory)`` (K = V = the encoder output; Agarwal §5.3).

What pretrained families add is chosen once in ``__init__``, each a small variant: biases on
W^Q, W^K, W^V alone (``qkv_bias``, Qwen2); q/k norms after the projection (:data:`QK_NORMS`,
Qwen3, Gemma 3, OLMo 2); partial or frequency-scaled rotary positions (:mod:`attnlab.nn.rotary`,
GPT-NeoX, Llama 3.1); another scale of the scores (``scale``, Gemma) and soft-capped scores
(``softcap``, Gemma 2, through the score function, so the explicit formula runs). Local
attention is a mask, built by the model (:func:`attnlab.nn.masks.sliding_window_mask`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.kernels import linear_kernel
from attnlab.nn.attention import NORMALIZERS
from attnlab.nn.attention_backends import ScoreFn, backend_setting
from attnlab.nn.head_subsets import check_heads_cap, check_kv_index, uniform_kv_index
from attnlab.nn.hooks import ATTENTION_POINTS, Hook, run_hooks
from attnlab.nn.kv_cache import KVCache
from attnlab.nn.masks import check_mask
from attnlab.nn.normalization import NORMS, make_norm
from attnlab.nn.position_bias import PositionBias, distances, make_position_bias
from attnlab.nn.qk_norm import QK_NORMS, NormFn
from attnlab.nn.rotary import RotaryEmbedding
from attnlab.nn.scores import make_score, soft_cap

__all__ = ["MultiHeadAttention", "set_attention_backend"]

PlaceFn = Callable[[RotaryEmbedding | None, Tensor, Tensor, Tensor | None, int], tuple[Tensor, Tensor]]
ShareFn = Callable[[Tensor, Tensor, int], tuple[Tensor, Tensor]]


def _unplaced(rotary: RotaryEmbedding | None, q: Tensor, k: Tensor, positions: Tensor | None, offset: int):
    """No rotary positions: queries and keys as projected."""
    return q, k


def _rotate_by_position(rotary: RotaryEmbedding | None, q: Tensor, k: Tensor, positions: Tensor | None, offset: int):
    """RoPE(q, m), RoPE(k, m) at ``positions``, or at offset, offset + 1, ... (the cache's length on)."""
    if positions is None:
        positions = torch.arange(offset, offset + q.shape[-2], device=q.device)  # (T,)
    return rotary(q, k, positions)  # type: ignore[misc]


def _own_key_values(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Multi-head attention: every query head has its own key/value head."""
    return k, v


def _share_key_values(k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention: key/value head j serves query heads j*g .. (j+1)*g - 1.

    Shape:
        k: (B, H_kv, T_k, d_k);  v: (B, H_kv, T_k, d_v);  returns both with H heads.
    """
    groups = heads // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


GROUPABLE_SCORES = ("scaled_dot", "dot")
"""Scores the same for every head (no per-head weights, ``score_fn`` None): grouped-query attention
with them folds a group's query heads into query rows (:meth:`MultiHeadAttention._attend_grouped`)."""


def set_attention_backend(model: nn.Module, backend: str) -> None:
    """Set the soft-attention backend of every :class:`MultiHeadAttention` in ``model``: ``auto``
    (measured) or a name of :data:`attnlab.nn.attention_backends.BACKEND_SETTINGS` (a ConfigError otherwise). The
    one place a built model's backend changes; nothing reads the environment per call."""
    backend = backend_setting(backend)
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.backend = backend


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = sum_h xi_h head_h W_o^h = Concat(xi_1 head_1, ..., xi_H head_H) W^O.

    (Vaswani §3.2.2; Michel §2.2 Eq. 1 and §2.3.)

    Args:
        d_model: model width; queries and keys/values come in with this size.
        heads: number of heads H.
        d_k: per-head query/key size; default d_model / H. d_k = d_model is allowed (Michel §2.2).
        d_v: per-head value size; default d_k.
        score: name in :data:`attnlab.nn.scores.SCORES` (``scaled_dot``, ``dot``, ``bilinear``,
            ``additive``).
        normalizer: the ``a`` of Attention = a(Q K^T / sqrt(d_k)) V, a name in
            :data:`attnlab.nn.attention.NORMALIZERS`: ``softmax`` (soft attention) or ``hardmax``
            (hard attention, Hahn §3). A config's ``attention = "soft" | "hard"`` names the same
            choice (:data:`attnlab.nn.config.ATTENTION_NORMALIZERS`).
        straight_through: hard attention trained with the soft gradient.
        dropout: dropout on the attention weights during training.
        bias: biases on the projections (W^O's always follows it).
        qkv_bias: biases on W^Q, W^K and W^V only (Qwen2: on q, k and v but not on W^O); None
            follows ``bias``.
        kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023): query head h reads
            key/value head h // (H / kv_heads); default H. The KV cache holds kv_heads heads.
        kv_index: an explicit query -> key/value head map instead (H entries; key/value heads
            0..max, each serving at least one query head), e.g. what is left of grouped-query
            attention after physical head pruning (:func:`attnlab.nn.head_subsets.head_subset_state`). A map that is the
            uniform h // (H / kv_heads) one takes the same path as ``kv_heads``.
        rope_base: rotate queries and keys by their positions in self-attention (rotary position
            embeddings, :mod:`attnlab.nn.rotary`) with this base; None for no rotation.
        rotary_fraction: rotate the first int(d_k * rotary_fraction) dims of each head only
            (partial rotary, GPT-NeoX).
        rope_scaling: a ``rope_scaling`` dict of :data:`attnlab.nn.rotary.ROPE_SCALINGS`, or None.
        qk_norm: a name in :data:`QK_NORMS`: ``none``, ``head`` or ``full``, the norm of the
            projected queries and keys before rotary positions.
        norm, norm_eps: the kind of the q/k norms (:data:`attnlab.nn.normalization.NORMS`) and its eps.
        scale: the scale of the scores in place of the score's own (d_k^-1/2 for ``scaled_dot``;
            Gemma: ``query_pre_attn_scalar`` ** -1/2).
        softcap: soft-cap the scores, c tanh(scores / c) after the scale and before the mask (and
            before a position bias; Gemma 2); None for none. Capped scores take the explicit
            attention formula.
        position_bias: relative positions on the scores (:mod:`attnlab.nn.position_bias`):
            ``alibi`` (Press et al. 2022) or ``relative`` (Shaw et al. 2018); None for none.
        relative_clip: the clipping distance k of ``relative``.
        backend: soft attention's implementation, resolved here, once (a runtime setting, not part
            of the architecture): ``auto`` (the fastest that applies, measured on this machine),
            or a name of :data:`attnlab.nn.attention_backends.BACKEND_SETTINGS` (``sdpa``, ``explicit``, ``short``,
            ``decode``), taken wherever it applies; None: the documented override
            ``ATTNLAB_BACKEND`` from the environment, read now, else ``auto``. Changed later by
            :func:`set_attention_backend`; never read from the environment per call.

    Shape:
        query: (B, T_q, d_model);  key, value: (B, T_k, d_model), or None for self-attention.
        mask: bool, True = may attend, broadcastable to (B, H, T_q, T_k).
        returns (B, T_q, d_model). The head mask xi (0/1 or real-valued, differentiable) is a
        scale of the ``z`` site: :func:`attnlab.nn.head_masks.masking_heads`.

    Attributes:
        in_proj_weight: (H*d_k + H_kv*d_k + H_kv*d_v, d_model): W^Q, W^K, W^V stacked, head h of
            each in rows h*d:(h+1)*d (the layout of ``torch.nn.MultiheadAttention``; H_kv = H
            unless ``kv_heads`` is set).
        out_proj: W^O, a Linear(H*d_v -> d_model).
        q_norm, k_norm: the q/k norms (``qk_norm`` other than ``none``), else None.
        hooks: point -> hooks of its named sites (:mod:`attnlab.nn.hooks`).
        backend: the resolved backend setting (see ``backend`` above).
    """

    backend = "auto"  # a module pickled before the setting existed runs the measured choice

    site_points = ATTENTION_POINTS
    """Its named sites, in the order it computes them (a lone module's are ``attn.POINT``)."""

    def __init__(
        self,
        d_model: int,
        heads: int,
        *,
        d_k: int | None = None,
        d_v: int | None = None,
        score: str = "scaled_dot",
        normalizer: str = "softmax",
        straight_through: bool = False,
        dropout: float = 0.0,
        bias: bool = True,
        kv_heads: int | None = None,
        rope_base: float | None = None,
        kv_index: list[int] | None = None,
        position_bias: str | None = None,
        relative_clip: int = 16,
        qkv_bias: bool | None = None,
        rotary_fraction: float = 1.0,
        rope_scaling: Mapping[str, Any] | None = None,
        qk_norm: str = "none",
        norm: str = "rms",
        norm_eps: float = 1e-6,
        scale: float | None = None,
        softcap: float | None = None,
        backend: str | None = None,
    ) -> None:
        super().__init__()
        self.backend = backend_setting(backend)  # resolved once: the override ATTNLAB_BACKEND is read here
        if heads < 0 or (heads == 0 and d_k is None):
            raise ValueError(f"heads={heads}: need heads >= 1, or heads = 0 (all pruned) with d_k set")
        check_heads_cap("heads", heads)
        check_heads_cap("kv_heads", kv_heads)
        if d_k is None and d_model % heads != 0:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}; set d_k explicitly")
        self.d_model, self.heads = d_model, heads
        self.d_k = d_k if d_k is not None else d_model // heads
        self.d_v = d_v if d_v is not None else self.d_k
        if kv_index is not None:
            mapped = check_kv_index(list(kv_index), heads)
            if kv_heads is not None and kv_heads != mapped:
                raise ValueError(f"kv_heads={kv_heads} disagrees with kv_index, which uses {mapped} key/value heads")
            kv_heads = mapped
        self.kv_heads = heads if kv_heads is None else kv_heads
        if self.kv_heads < 0 or (heads and (self.kv_heads == 0 or (kv_index is None and heads % self.kv_heads))):
            raise ValueError(f"kv_heads={kv_heads}: must divide heads={heads}")
        uniform = uniform_kv_index(heads, self.kv_heads) if heads and heads % self.kv_heads == 0 else []
        self.kv_index: list[int] = list(kv_index) if kv_index is not None else uniform_kv_index(heads, self.kv_heads)
        # Chosen once: rotary positions on queries and keys, or none; K/V heads shared by groups.
        self.rotary = (
            RotaryEmbedding(self.d_k, rope_base, fraction=rotary_fraction, scaling=rope_scaling)
            if rope_base is not None
            else None
        )
        self._place: PlaceFn = _rotate_by_position if self.rotary is not None else _unplaced
        # Chosen once: a bias on the scores from the distance j - i (ALiBi, Shaw et al.), or none.
        self.position_bias: PositionBias | None = (
            None
            if position_bias is None
            else make_position_bias(position_bias, heads=heads, d_k=self.d_k, d_v=self.d_v, clip=relative_clip)
        )
        if self.kv_index == uniform:  # the fast paths: one K/V head per query head, or equal groups
            self._share: ShareFn = _share_key_values if self.kv_heads != heads else _own_key_values
        else:  # an irregular map (pruned grouped-query attention): gather K/V heads by index
            self.register_buffer("_kv_gather", torch.tensor(self.kv_index, dtype=torch.long), persistent=False)
            self._share = self._gather_key_values
        self.dropout = dropout
        self.straight_through = straight_through
        try:  # chosen once: the softmax or hardmax attention of attnlab.nn.attention
            self._normalize = NORMALIZERS[normalizer]
        except KeyError:
            raise ValueError(f"normalizer: unknown {normalizer!r}; allowed: {', '.join(sorted(NORMALIZERS))}") from None
        self.normalizer = normalizer
        self.score = make_score(score, heads=heads, d_k=self.d_k)
        if scale is not None:
            self.score.scale = scale
        # Chosen once: the pairwise score the attention takes, soft-capped or the score's own
        # (None: scale q.k on the fused kernels).
        self.softcap = softcap
        self._pairwise: ScoreFn | None = self.score.score_fn if softcap is None else self._capped_scores
        # Chosen once: equal groups of query heads over K/V heads, with a score that treats every
        # head alike, attend without copying K and V per query head at a decoding step.
        grouped = self.kv_heads not in (0, heads) and self.kv_index == uniform
        self._attend = self._attend_grouped if grouped and score in GROUPABLE_SCORES else self._attend_shared
        self._linear = linear_kernel()  # x W^T + b, for W^Q, W^K, W^V and W^O (ATTNLAB_LINEAR)
        qk, vv = heads * self.d_k, heads * self.d_v
        self._split = (qk, self.kv_heads * self.d_k, self.kv_heads * self.d_v)
        self.in_proj_weight = nn.Parameter(torch.empty(sum(self._split), d_model))
        in_bias = bias if qkv_bias is None else qkv_bias
        self.in_proj_bias = nn.Parameter(torch.zeros(sum(self._split))) if in_bias else None
        with warnings.catch_warnings():  # a fully pruned layer has zero-element weights by design
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            self.out_proj = nn.Linear(vv, d_model, bias=bias)
            nn.init.xavier_uniform_(self.in_proj_weight)
        if bias:
            nn.init.zeros_(self.out_proj.bias)
        # Chosen once: queries and keys normalised after the projection (Qwen3, OLMo 2), or not.
        if qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm: unknown {qk_norm!r}; allowed: {', '.join(sorted(QK_NORMS))}")
        self.qk_norm = QK_NORMS[qk_norm]
        widths = self.qk_norm.widths
        self.q_norm, self.k_norm = (
            (None, None)
            if widths is None
            else (make_norm(norm, width, norm_eps) for width in widths(heads, self.kv_heads, self.d_k))
        )
        self._norm_fn: NormFn = NORMS[norm].apply
        self.hooks: dict[str, list[Hook]] = {}  # sites of ATTENTION_POINTS (attnlab.nn.hooks)

    def forward(
        self,
        query: Tensor,
        key: Tensor | None = None,
        value: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        causal: bool = False,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
        key_positions: Tensor | None = None,
    ) -> Tensor:
        """sum_h xi_h Attention(Q W_h^Q, K W_h^K, V W_h^V) W_o^h + b^O.

        xi is the head mask, a hook scaling the ``z`` site (:func:`attnlab.nn.head_masks.masking_heads`);
        without hooks xi = 1 and the fused path runs.

        Args:
            query: the queries' inputs.
            key: the keys' inputs; None for self-attention (K = V = query).
            value: the values' inputs; None for K = V (encoder-decoder attention over ``key``).
            mask: bool, True = may attend.
            causal: also block keys after each query (masked decoder self-attention).
            cache: keys and values kept across decoding steps.
            positions: (B, T_q) or (T_q,) positions of the queries, for rotary positions and
                position biases; default the cache's length onwards.
            key_positions: (B, T_k) or (T_k,) positions of all keys (the cache's included), for
                position biases; default 0, 1, ..., T_k - 1.

        Returns:
            (B, T_q, d_model).
        """
        if self.heads == 0:
            return self._without_heads(query, key, cache)
        offset = 0 if cache is None else len(cache)
        hooks = self.hooks
        q, k, v = self._project(query, key, value, cache, positions)  # (B, H|H_kv, T, d_k|d_v) each
        attend, want_weights = self._attend, False
        if hooks:  # named sites (attnlab.nn.hooks): read or edit q, k, v; scores and pattern explicitly
            q, k, v = run_hooks(hooks, "q", q), run_hooks(hooks, "k", k), run_hooks(hooks, "v", v)
            if "scores" in hooks or "pattern" in hooks:
                attend, want_weights = self._attend_hooked, True
        if self.position_bias is None:
            head_outputs, _ = attend(q, k, v, mask, causal, want_weights)  # (B, H, T_q, d_v)
        else:
            head_outputs, _ = self._attend_biased(
                q, k, v, mask, causal, want_weights, positions, key_positions, offset, attend
            )
        if not hooks:
            return self._combine_heads(head_outputs)
        return self._combine_hooked(run_hooks(hooks, "z", head_outputs), hooks)  # z: xi_h head_h (Michel §2.3)

    def _capped_scores(self, q: Tensor, k: Tensor) -> Tensor:
        """c tanh(e / c) of the score's own e (scale q.k for dot products), Gemma 2's soft-capping.

        Shape:
            q: (..., T_q, d_k);  k: (..., T_k, d_k);  returns (..., T_q, T_k).
        """
        own = self.score.score_fn
        scores = own(q, k) if own is not None else torch.matmul(q, k.transpose(-2, -1)) * self.score.scale
        return soft_cap(scores, self.softcap)  # type: ignore[arg-type]

    def _combine_heads(self, head_outputs: Tensor) -> Tensor:
        """Concat(xi_1 head_1, ..., xi_H head_H) W^O + b^O = sum_h xi_h head_h W_o^h + b^O.

        Shape:
            head_outputs: (B, H, T_q, d_v);  returns (B, T_q, d_model).
        """
        batch, _, t_q, _ = head_outputs.shape
        concat = head_outputs.transpose(1, 2).reshape(batch, t_q, self.heads * self.d_v)  # (B, T_q, H*d_v)
        return self._linear(concat, self.out_proj.weight, self.out_proj.bias)

    def _combine_hooked(self, head_outputs: Tensor, hooks: dict[str, list[Hook]]) -> Tensor:
        """:meth:`_combine_heads` with the ``result`` site (each head's term xi_h head_h W_o^h, summed
        after it is read or edited) and the ``out`` site."""
        if "result" in hooks:
            result = run_hooks(hooks, "result", self.head_contributions(head_outputs))  # (B, H, T_q, d_model)
            output = result.sum(1)
            if self.out_proj.bias is not None:
                output = output + self.out_proj.bias
        else:
            output = self._combine_heads(head_outputs)
        return run_hooks(hooks, "out", output)

    def _attend_hooked(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        want_weights: bool,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`_attend_shared` with the ``scores`` and ``pattern`` sites: the scores (scale q.k, or
        the score function's, plus any position bias) go through their hooks before the mask and
        a(.); the weights through theirs, and an edited pattern is what multiplies V.

        Shape:
            as :meth:`_attend_shared`; the weights are always returned.
        """
        hooks = self.hooks
        pairwise, scale = self._pairwise, self.score.scale

        def scores(q_: Tensor, k_: Tensor) -> Tensor:  # (B, H, T_q, T_k), after score.prepare
            raw = pairwise(q_, k_) if pairwise is not None else torch.matmul(q_, k_.transpose(-2, -1)) * scale
            return run_hooks(hooks, "scores", raw if bias is None else raw + bias.to(raw.dtype))

        head_outputs, weights = self._attend_shared(q, k, v, mask, causal, True, score_fn=scores)
        if "pattern" in hooks:
            edited = run_hooks(hooks, "pattern", weights)
            if edited is not weights:
                _, v = self._share(k, v, self.heads)  # (B, H, T_k, d_v): what the weights multiply
                head_outputs, weights = torch.matmul(edited.to(v.dtype), v), edited
        return head_outputs, weights

    def _attend_biased(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        want_weights: bool,
        positions: Tensor | None,
        key_positions: Tensor | None,
        offset: int,
        attend: Callable[..., tuple[Tensor, Tensor | None]],
    ) -> tuple[Tensor, Tensor | None]:
        """Attention with the position bias's additive scores (and its value term, for Shaw et al.).

        The distance j - i comes from the given positions, or from offset, offset + 1, ... for the
        queries (a KV cache's length on) and 0, 1, ... for the keys. ``attend`` is
        :meth:`_attend` or, with hooked sites, :meth:`_attend_hooked`.
        """
        t_q, t_k = q.shape[-2], k.shape[-2]
        if positions is None:
            positions = torch.arange(offset, offset + t_q, device=q.device)
        if key_positions is None:
            key_positions = torch.arange(t_k, device=q.device)
        distance = distances(positions.reshape(-1, t_q), key_positions.reshape(-1, t_k))  # (B|1, T_q, T_k)
        bias_module = self.position_bias
        assert bias_module is not None
        bias = bias_module(self.score.prepare(q, q)[0], distance, self.score.scale)  # (B|1, H, T_q, T_k)
        need = want_weights or bias_module.needs_weights
        head_outputs, weights = attend(q, k, v, mask, causal, need, bias)
        return bias_module.add_values(head_outputs, weights, distance), weights if want_weights else None

    def _attend_shared(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        want_weights: bool,
        bias: Tensor | None = None,
        score_fn: ScoreFn | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """head_h = Attention(Q W_h^Q, K W_h^K, V W_h^V), each query head with its K/V head's copy.

        ``score_fn`` replaces the score module's pairwise score (scale and ``bias`` included: it is
        what :meth:`_attend_hooked` passes, with ``bias`` None).

        Shape:
            q: (B, H, T_q, d_k);  k, v: (B, H_kv, T_k, d_k|d_v);  returns (B, H, T_q, d_v) and the
            weights (B, H, T_q, T_k) or None.
        """
        k, v = self._share(k, v, self.heads)  # (B, H, T_k, d_k|d_v): head h reads K/V head h // groups
        check_mask(mask, q.shape[-2], k.shape[-2])
        q, k = self.score.prepare(q, k)
        return self._normalize(
            q,
            k,
            v,
            mask,
            causal=causal,
            scale=self.score.scale,
            score_fn=self._pairwise if score_fn is None else score_fn,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=want_weights,
            straight_through=self.straight_through,
            bias=bias,
            backend=self.backend,
        )

    def _attend_grouped(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None,
        causal: bool,
        want_weights: bool,
        bias: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """:meth:`_attend_shared` for grouped-query attention without copying K and V.

        One query row (a decoding step) of the g query heads of a group is g rows of one query
        against the group's K/V head: q (B, H, 1, d_k) is viewed as (B, H_kv, g, d_k). Causality is
        no constraint there (the one query is the last key), and a mask without a head axis
        broadcasts over the rows. Several query rows, or a mask per head, take the shared path.
        """
        batch, heads, t_q, _ = q.shape
        per_head_mask = mask is not None and mask.dim() >= 3 and mask.shape[-3] != 1
        if t_q != 1 or per_head_mask:
            return self._attend_shared(q, k, v, mask, causal, want_weights, bias)
        kv_heads = k.shape[1]
        check_mask(mask, t_q, k.shape[-2])
        rows = q.reshape(batch, kv_heads, heads // kv_heads, q.shape[-1])  # (B, H_kv, g, d_k)
        if bias is not None:  # (B|1, H, 1, T_k) -> (B|1, H_kv, g, T_k), the rows' order
            bias = bias.reshape(bias.shape[0], kv_heads, heads // kv_heads, bias.shape[-1])
        outputs, weights = self._normalize(
            rows,
            k,
            v,
            mask,
            causal=False,
            scale=self.score.scale,
            score_fn=self._pairwise,
            dropout_p=self.dropout if self.training else 0.0,
            need_weights=want_weights,
            straight_through=self.straight_through,
            bias=bias,
            backend=self.backend,
        )  # (B, H_kv, g, d_v)
        unfolded = None if weights is None else weights.reshape(batch, heads, 1, weights.shape[-1])
        return outputs.reshape(batch, heads, 1, outputs.shape[-1]), unfolded

    def _without_heads(self, query: Tensor, key: Tensor | None, cache: KVCache | None) -> Tensor:
        """A layer whose heads were all pruned: the sum over no heads is 0, so the output is W^O's
        bias alone (as when every head is masked). Its ``pattern`` and ``z`` hooks see empty
        tensors (B, 0, T_q, T_k) and (B, 0, T_q, d_v)."""
        batch, t_q, _ = query.shape
        t_k = t_q if key is None else key.shape[1]
        if cache is not None and key is None:  # self-attention: the cache still counts the keys seen
            no_heads = query.new_zeros(batch, 0, t_q, self.d_k)  # (B, 0, T_q, d_k): no K/V heads either
            t_k = cache.append(no_heads, no_heads.new_zeros(batch, 0, t_q, self.d_v))[0].shape[-2]
        output = query.new_zeros(batch, t_q, self.d_model)
        if self.out_proj.bias is not None:
            output = output + self.out_proj.bias
        if self.hooks:
            run_hooks(self.hooks, "pattern", query.new_zeros(batch, 0, t_q, t_k))
            run_hooks(self.hooks, "z", query.new_zeros(batch, 0, t_q, self.d_v))
        return output

    def _gather_key_values(self, k: Tensor, v: Tensor, heads: int) -> tuple[Tensor, Tensor]:
        """An explicit map: query head h reads key/value head ``kv_index[h]``.

        Shape:
            k: (B, H_kv, T_k, d_k);  v: (B, H_kv, T_k, d_v);  returns both with H heads.
        """
        return k.index_select(1, self._kv_gather), v.index_select(1, self._kv_gather)

    # ---- projections --------------------------------------------------------------------

    def _project(
        self,
        query: Tensor,
        key: Tensor | None,
        value: Tensor | None,
        cache: KVCache | None,
        positions: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        if key is None:  # self-attention: one fused matmul for Q, K and V
            if value is not None:
                raise ValueError("MultiHeadAttention: value given without key")
            q, k, v = self._linear(query, self.in_proj_weight, self.in_proj_bias).split_with_sizes(self._split, dim=-1)
            normalize, norm_fn = self.qk_norm.apply, self._norm_fn
            q, k = normalize(norm_fn, self.q_norm, q, self.d_k), normalize(norm_fn, self.k_norm, k, self.d_k)
            q, k, v = self._split_heads(q, self.heads), self._split_heads(k), self._split_heads(v)
            if self.hooks:  # the sites q_pre, k_pre: before rotary positions (attnlab.nn.hooks)
                q, k = run_hooks(self.hooks, "q_pre", q), run_hooks(self.hooks, "k_pre", k)
            q, k = self._place(self.rotary, q, k, positions, 0 if cache is None else len(cache))
            if cache is not None:
                k, v = cache.append(k, v)
            return q, k, v
        value = key if value is None else value
        weight, bias, qk = self.in_proj_weight, self.in_proj_bias, self._split[0]
        normalize, norm_fn = self.qk_norm.apply, self._norm_fn
        q = self._linear(query, weight[:qk], None if bias is None else bias[:qk])
        q = self._split_heads(normalize(norm_fn, self.q_norm, q, self.d_k), self.heads)
        if self.hooks:  # q_pre and k_pre: no rotary positions in attention over another sequence
            q = run_hooks(self.hooks, "q_pre", q)

        def project_memory() -> tuple[Tensor, Tensor]:  # not called again once a cache keeps K, V
            if value is key:  # encoder-decoder attention, K = V = memory: one matmul
                k_, v_ = self._linear(key, weight[qk:], None if bias is None else bias[qk:]).split(
                    self._split[1:], dim=-1
                )
            else:
                _, w_k, w_v = weight.split(self._split, dim=0)
                b_k, b_v = (None, None) if bias is None else bias.split(self._split)[1:]
                k_, v_ = self._linear(key, w_k, b_k), self._linear(value, w_v, b_v)
            k_ = self._split_heads(normalize(norm_fn, self.k_norm, k_, self.d_k))
            return k_ if not self.hooks else run_hooks(self.hooks, "k_pre", k_), self._split_heads(v_)

        k, v = cache.keep(project_memory) if cache is not None else project_memory()
        return q, k, v

    def _split_heads(self, x: Tensor, heads: int | None = None) -> Tensor:
        """(B, T, heads*d) -> (B, heads, T, d); keys and values have ``kv_heads`` heads."""
        heads = self.kv_heads if heads is None else heads
        batch, length, width = x.shape
        return x.view(batch, length, heads, width // heads).transpose(1, 2)  # (B, heads, T, d)

    def head_contributions(self, head_outputs: Tensor) -> Tensor:
        """Att_h = head_h W_o^h for every head (Michel §2.2 Eq. 1); their sum + bias is the output.

        Shape:
            head_outputs: (B, H, T_q, d_v);  returns (B, H, T_q, d_model).
        """
        w_o = self.out_proj.weight.view(self.d_model, self.heads, self.d_v)  # (d_model, H, d_v)
        return torch.einsum("bhtv,mhv->bhtm", head_outputs, w_o)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, heads={self.heads}, kv_heads={self.kv_heads}, d_k={self.d_k}, d_v={self.d_v}, "
            f"normalizer={self.normalizer}, straight_through={self.straight_through}, dropout={self.dropout}"
        )
