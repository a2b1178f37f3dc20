"""Model configurations: frozen dataclasses, validated at construction; the options every model shares.

Every option that names a variant is checked against the registry that implements it, so a config
can only name what exists. An invalid value raises ``ValueError`` naming the field and the allowed
values; :meth:`TransformerConfig.from_dict` also rejects unknown keys, listing the allowed ones.
The four kinds of model, what differs between them, and the presets are in
:mod:`attnlab.nn.model_configs`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from attnlab.errors import ConfigError, check_field_types
from attnlab.limits import MAX_LAYERS
from attnlab.nn.feed_forward import ACTIVATIONS
from attnlab.nn.head_subsets import check_heads_cap
from attnlab.nn.layers import PLACEMENTS
from attnlab.nn.normalization import NORMS
from attnlab.nn.positional import COMBINES, POSITIONAL, RANDOMIZABLE
from attnlab.nn.qk_norm import QK_NORMS
from attnlab.nn.rotary import rope_frequencies
from attnlab.nn.scores import SCORES

__all__ = [
    "TransformerConfig",
    "ATTENTION_NORMALIZERS",
    "RETIRED_KEYS",
    "POOLINGS",
    "check_positive",
    "check_choice",
    "check_layers_cap",
]

ATTENTION_NORMALIZERS = {"soft": "softmax", "hard": "hardmax"}
"""The one place the two vocabularies of the same choice meet: a config's ``attention`` (``soft`` or
``hard``, the words of config.json and TOML files) -> the normalizer ``a`` of
:func:`attnlab.nn.attention.attention` and :class:`attnlab.nn.multi_head.MultiHeadAttention`
(``softmax`` or ``hardmax``, the names of :data:`attnlab.nn.attention.NORMALIZERS`)."""

RETIRED_KEYS = frozenset({"linear"})
"""Keys that older configs (and runs' config.json) hold and that are no longer architecture,
accepted and ignored: ``linear``, the GEMM kernel, now the runtime setting ``ATTNLAB_LINEAR``
(:func:`attnlab.kernels.linear.linear_setting`)."""

POOLINGS = ("eos", "first", "mean")
"""Readouts of :class:`attnlab.nn.models.EncoderClassifier` (``eos``: Hahn §3)."""

C = TypeVar("C", bound="TransformerConfig")


@dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """Options shared by every model.

    Attributes:
        vocab_size: input vocabulary size (for an encoder-decoder: the source vocabulary).
        layers: number of layers N (for an encoder-decoder: encoder layers).
        d_model: model width.
        heads: attention (query) heads H per layer.
        kv_heads: key/value heads (grouped-query attention, Ainslie et al. 2023): H / kv_heads
            query heads share each; default H (multi-head attention). The head mask stays one
            entry per query head.
        d_ff: FFN hidden width.
        d_k, d_v: per-head key/value width; default d_model / heads.
        dropout: dropout on every sub-layer output and on the embedding sums (Vaswani §5.4).
        attention_dropout: dropout on attention weights.
        activation_dropout: dropout on the FFN's hidden activations (not in the paper; 0 by default).
        attention: ``soft`` (softmax) or ``hard`` (hardmax, Hahn §3).
        straight_through: train hard attention with the softmax gradient.
        score: ``scaled_dot``, ``dot``, ``bilinear`` or ``additive``.
        positional: ``sinusoidal``, ``learned``, ``none``, ``gehring_joint``, ``gehring_sum``, or
            ``rope`` (rotary, applied to queries and keys in every self-attention: :mod:`attnlab.nn.rotary`).
            ``alibi`` (linear biases on the scores, Press et al. 2022) or ``relative`` (learned
            relative representations, Shaw et al. 2018): :mod:`attnlab.nn.position_bias`.
        rope_base: the base of the rotary angles (``positional = "rope"``).
        rotary_fraction: rotate only the first int(d_k * rotary_fraction) dims of each query and
            key head, the rest passing unchanged (partial rotary: GPT-NeoX's ``rotary_pct``,
            Phi-3's ``partial_rotary_factor``); the rotated width must be even and > 0.
        rope_scaling: Hugging Face's ``rope_scaling`` dict (``rope_type`` or ``type``: ``linear``,
            ``llama3``, ``yarn`` or ``default``, with that type's parameters), scaling the rotary
            frequencies (:data:`attnlab.nn.rotary.ROPE_SCALINGS`); None for none.
        relative_clip: the clipping distance k of ``positional = "relative"`` (Shaw et al. §3.2).
        randomized_positions: M, or None/0 for off: in training, each sequence's positions are an
            ordered random subset of [0, M) instead of 0..T-1 (Ruoss et al. 2023); in evaluation
            0..T-1. For ``sinusoidal``, ``learned`` (needs max_len >= M), ``rope``, ``alibi`` and
            ``relative``; a training sequence longer than M is an error.
        positional_combine: ``add`` or ``concat`` (Hahn §3's f(v_i, p_i)).
        positional_dim: width of the position vector when concatenating; default d_model // 2.
        max_len: longest sequence for learned and one-hot positions; sinusoidal ones extrapolate.
        activation: FFN activation, ``relu``, ``gelu``, ``gelu_tanh``, ``swiglu`` (gated, Llama) or
            ``geglu`` (gated by GELU with the tanh approximation, Gemma; W_1 = [W_gate; W_up]).
        norm: ``layer`` (LayerNorm), ``rms`` (RMSNorm, Llama) or ``rms_one_plus`` (Gemma's RMSNorm,
            (1 + w) a / rms(a), w starting at 0) in Add & Norm, the final norm and the q/k norms.
        sliding_window: local attention (Mistral, Gemma 2/3): in the layers of ``sliding_layers``,
            query i attends to keys j with i - sliding_window < j <= i (Hugging Face's convention,
            positions counted over the sequence's columns, padding included); None: none.
            Decoder-only models.
        sliding_layers: the layers (0-based) with local attention; None: every layer.
        local_rope_base: the rotary base of the local layers (Gemma 3); there, no ``rope_scaling``
            (which applies to the other layers only). None: the local layers rotate as the others.
        attention_softcap: soft-cap the attention scores, c tanh(scores / c) after the scale and
            before the mask (Gemma 2); the explicit attention formula then runs (no fused kernel).
            None: none.
        final_softcap: soft-cap the logits, c tanh(logits / c) (Gemma 2); decoder-only models.
        query_scale: the scale of the attention scores where it is not d_k^-1/2 (Gemma:
            ``query_pre_attn_scalar ** -0.5``); the scale itself. ``score = "scaled_dot"`` only.
        qk_norm: ``none``, ``head`` (a norm over d_k on each query and key head, one gain of size
            d_k shared by the heads: Qwen3, Gemma 3) or ``full`` (a norm over the whole H*d_k query
            projection and the whole H_kv*d_k key projection: OLMo 2), after the projection and
            before rotary positions, of the kind ``norm`` (:data:`attnlab.nn.qk_norm.QK_NORMS`);
            parameters ``q_norm.weight`` and ``k_norm.weight`` of the attention module.
        norm_first: pre-LN instead of the paper's post-LN; read only where ``norm_placement`` is None.
        norm_placement: where each sub-layer's norms sit (:data:`attnlab.nn.layers.PLACEMENTS`):
            ``post`` Norm(x + f(x)) (Vaswani), ``pre`` x + f(Norm(x)), ``sandwich``
            x + Norm_post(f(Norm(x))) (Gemma 2/3), ``output`` x + Norm(f(x)) (OLMo 2); None: ``pre``
            if ``norm_first`` else ``post``. Stacks of all but ``post`` end with a final norm.
        parallel_residual: x + Attn(Norm_1(x)) + FFN(Norm_2(x)), both sub-layers on the layer's
            input (GPT-J, GPT-NeoX); needs a placement other than ``post``.
        layer_norm_eps: the epsilon of the norm (LayerNorm or RMSNorm).
        pad_id: the padding token id; keys at padding are masked out.
        scale_embeddings: multiply token embeddings by sqrt(d_model) (Vaswani §3.4).
        type_vocab_size: number of token types (segments A/B) with a learned vector each, added to
            the token and position vectors as in BERT; 0 means none.
        embedding_norm: LayerNorm the summed input embedding (BERT) before dropout.
        bias: biases in every linear map (attention projections, FFN, output layer); Llama has none.
        qkv_bias: biases on W^Q, W^K and W^V only (Qwen2 has them there and nowhere else); None
            follows ``bias``. W^O, the FFN and the output layer follow ``bias``.
        heads_per_layer: after physical head pruning: attention kind -> the number of heads left
            in each layer of that kind (0 allowed: the sub-layer then adds only its output bias).
            Kinds not listed keep ``heads``. Needs ``d_k`` set, since d_model / H no longer applies.
        kv_groups: after physical pruning of grouped-query attention: attention kind -> for each
            layer, the key/value head each remaining query head reads (``kv_groups[kind][layer][h]``,
            key/value heads numbered 0.. in their old order, each serving some query head); the
            layer then has max + 1 key/value heads. Needs ``heads_per_layer`` for the same kinds.
    """

    kind: ClassVar[str] = ""
    language_model: ClassVar[bool] = False
    """Whether the model is a causal language model: it reads one sequence and predicts the next
    token at every position, so it may have sliding-window layers and soft-capped logits; a text
    is given to it framed as the task's prompt (``task.generation_prompt``: BOS, a chat template),
    it writes by continuing that prompt within the same context, and only it chats and has
    next-token logits to attribute."""
    reads_source_and_target: ClassVar[bool] = False
    """Whether the model reads two sequences, ``model(src, tgt_in)``: a source for its encoder
    and a target, from BOS, for its decoder. It writes an output of its own from BOS, which stops
    at the model's last position whatever the source's length (at most ``max_len - 1`` new tokens),
    and its heads are scored on source<TAB>target pairs."""
    predicts_class: ClassVar[bool] = False
    """Whether the model's output is one label per example (a class and its probability), not tokens."""
    embeds_sentences: ClassVar[bool] = False
    """Whether the model is a sentence encoder: its output is its last hidden states, pooled into
    one embedding per text; it generates nothing."""
    throughput_key: ClassVar[str] = "tokens_per_s"
    """The key of a training step record's rate: predictions per second, tokens, or examples for a
    model that predicts one label per example."""
    has_perplexity: ClassVar[bool] = True
    """Whether the evaluation loss is a mean cross-entropy over a vocabulary of tokens, so that
    exp(loss) is a perplexity (a classifier's loss over its labels is not)."""
    input_extra_positions: ClassVar[int] = 1
    """Positions an input of n tokens takes beside them in the model's context: EOS after the
    source (1; encoder-decoder, classifier), BOS before the prompt and one generated token
    (2; language model), none (0; a sentence encoder reads its tokens as given)."""

    vocab_size: int = 32
    layers: int = 2
    d_model: int = 64
    heads: int = 4
    kv_heads: int | None = None
    d_ff: int = 256
    d_k: int | None = None
    d_v: int | None = None
    dropout: float = 0.1
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    attention: str = "soft"
    straight_through: bool = False
    score: str = "scaled_dot"
    positional: str = "sinusoidal"
    positional_combine: str = "add"
    positional_dim: int | None = None
    rope_base: float = 10000.0
    rotary_fraction: float = 1.0
    rope_scaling: dict[str, Any] | None = None
    relative_clip: int = 16
    randomized_positions: int | None = None
    max_len: int = 512
    activation: str = "relu"
    norm: str = "layer"
    sliding_window: int | None = None
    sliding_layers: list[int] | None = None
    local_rope_base: float | None = None
    attention_softcap: float | None = None
    final_softcap: float | None = None
    query_scale: float | None = None
    qk_norm: str = "none"
    norm_first: bool = False
    norm_placement: str | None = None
    parallel_residual: bool = False
    layer_norm_eps: float = 1e-5
    pad_id: int = 0
    scale_embeddings: bool = True
    type_vocab_size: int = 0
    embedding_norm: bool = False
    bias: bool = True
    qkv_bias: bool | None = None
    heads_per_layer: dict[str, list[int]] | None = None
    kv_groups: dict[str, list[list[int]]] | None = None

    def __post_init__(self) -> None:
        check_field_types(self)
        for name in ("vocab_size", "layers", "d_model", "heads", "d_ff", "max_len"):
            check_positive(name, getattr(self, name))
        for name in ("d_k", "d_v", "positional_dim", "kv_heads"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        for name in ("heads", "kv_heads"):  # a ConfigError before a list over the heads is built
            check_heads_cap(name, getattr(self, name))
        check_layers_cap("layers", self.layers)
        if self.d_k is None and self.d_model % self.heads != 0:
            raise ConfigError(
                f"d_model: {self.d_model} is not divisible by heads={self.heads}; "
                "choose d_model as a multiple of heads or set d_k"
            )
        if self.type_vocab_size < 0:
            raise ConfigError(f"type_vocab_size: must be >= 0 (0 = no token types), got {self.type_vocab_size}")
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name}: must lie in [0, 1), got {value}")
        if self.layer_norm_eps <= 0:
            raise ConfigError(f"layer_norm_eps: must be > 0, got {self.layer_norm_eps}")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ConfigError(f"pad_id: must lie in [0, vocab_size={self.vocab_size}), got {self.pad_id}")
        check_choice("attention", self.attention, ATTENTION_NORMALIZERS)
        check_choice("score", self.score, SCORES)
        check_choice("positional", self.positional, POSITIONAL)
        check_choice("positional_combine", self.positional_combine, COMBINES)
        check_choice("activation", self.activation, ACTIVATIONS)
        check_choice("norm", self.norm, NORMS)
        check_choice("qk_norm", self.qk_norm, QK_NORMS)
        if self.norm_placement is not None:
            check_choice("norm_placement", self.norm_placement, PLACEMENTS)
        if self.parallel_residual and PLACEMENTS[self.placement].branch is None:
            raise ConfigError(
                f"parallel_residual: needs norm layers with a residual branch (pre, sandwich, output), "
                f"not {self.placement!r}"
            )
        self._check_rotary_and_groups()
        if self.positional_combine == "concat" and not 0 < self.positional_width < self.d_model:
            raise ConfigError(
                f"positional_dim: must lie in (0, d_model={self.d_model}) to concatenate, got {self.positional_width}"
            )
        if self.straight_through and self.attention != "hard":
            raise ConfigError("straight_through: only applies to attention='hard'")
        self._check_heads_per_layer()
        self._check_kv_groups()

    def _check_rotary_and_groups(self) -> None:
        if self.kv_heads is not None and self.heads % self.kv_heads:
            raise ConfigError(f"kv_heads: must divide heads={self.heads}, got {self.kv_heads}")
        if self.kv_heads is not None and self.kv_heads != self.heads and self.score not in ("scaled_dot", "dot"):
            raise ConfigError(f"kv_heads: grouped-query attention needs a dot-product score, not {self.score!r}")
        if not 0 < self.rope_base < math.inf:
            raise ConfigError(f"rope_base: must be a positive number, got {self.rope_base}")
        if self.positional == "rope" and self.head_dim_k % 2:
            raise ConfigError(f"positional: rope needs an even head size d_k, got {self.head_dim_k}")
        self._check_rotary_variants()
        self._check_local_attention()
        self._check_caps_and_scale()
        self._check_relative_positions()

    def _check_rotary_variants(self) -> None:
        if not 0.0 < self.rotary_fraction <= 1.0:
            raise ConfigError(f"rotary_fraction: must lie in (0, 1], got {self.rotary_fraction}")
        rotated = int(self.head_dim_k * self.rotary_fraction)
        if self.positional == "rope" and (rotated % 2 or rotated == 0):
            raise ConfigError(
                f"rotary_fraction: int(d_k * rotary_fraction) = {rotated} rotated dims; it must be even and > 0"
            )
        if self.rope_scaling is not None:
            if self.positional != "rope":
                raise ConfigError(f"rope_scaling: applies to positional='rope' only, not {self.positional!r}")
            rope_frequencies(self.rope_base, rotated, self.rope_scaling)  # a ValueError naming rope_scaling

    def _check_local_attention(self) -> None:
        window, layers = self.sliding_window, self.sliding_layers
        if window is not None:
            if not self.language_model:
                raise ConfigError(f"sliding_window: applies to decoder-only models, not {self.kind or 'this model'}")
            check_positive("sliding_window", window)
        if layers is not None:
            if window is None:
                raise ConfigError("sliding_layers: needs sliding_window")
            if any(not _is_int(i) or not 0 <= i < self.layers for i in layers) or len(set(layers)) != len(layers):
                raise ConfigError(
                    f"sliding_layers: expected distinct layer indices in [0, {self.layers}), got {layers!r}"
                )
        if self.local_rope_base is not None:
            if window is None or self.positional != "rope":
                raise ConfigError("local_rope_base: needs sliding_window and positional='rope'")
            if not 0 < self.local_rope_base < math.inf:
                raise ConfigError(f"local_rope_base: must be a positive number, got {self.local_rope_base}")

    def _check_caps_and_scale(self) -> None:
        for name in ("attention_softcap", "final_softcap", "query_scale"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name}: must be a positive number (or none), got {value}")
        if self.final_softcap is not None and not self.language_model:
            raise ConfigError(f"final_softcap: applies to decoder-only models, not {self.kind or 'this model'}")
        if self.query_scale is not None and self.score != "scaled_dot":
            raise ConfigError(f"query_scale: replaces the scale of score='scaled_dot', not of {self.score!r}")

    def is_local_layer(self, layer: int) -> bool:
        """Whether ``layer`` has sliding-window attention."""
        return self.sliding_window is not None and (self.sliding_layers is None or layer in self.sliding_layers)

    def _check_relative_positions(self) -> None:
        check_positive("relative_clip", self.relative_clip)
        if self.positional == "relative" and self.score not in ("scaled_dot", "dot"):
            raise ConfigError(f"positional: relative (Shaw et al.) needs a dot-product score, not {self.score!r}")
        limit = self.randomized_positions
        if not limit:
            return
        if limit < 0:
            raise ConfigError(f"randomized_positions: must be a positive integer (0 or none: off), got {limit}")
        if self.positional not in RANDOMIZABLE:
            raise ConfigError(
                f"randomized_positions: does not apply to positional={self.positional!r}; "
                f"it applies to {', '.join(RANDOMIZABLE)}"
            )
        if self.positional == "learned" and self.max_len < limit:
            raise ConfigError(
                f"randomized_positions: M={limit} needs learned positions for all of [0, M), but max_len={self.max_len}"
            )

    @property
    def key_value_heads(self) -> int:
        """kv_heads, or H when not set."""
        return self.kv_heads if self.kv_heads is not None else self.heads

    def _check_heads_per_layer(self) -> None:
        if self.heads_per_layer is None:
            return
        if self.d_k is None:
            raise ConfigError("heads_per_layer: needs d_k set explicitly (pruned layers keep the original head size)")
        for kind, counts in self.heads_per_layer.items():
            if kind not in ("encoder_self", "decoder_self", "cross", "self"):
                raise ConfigError(
                    f"heads_per_layer: unknown kind {kind!r}; allowed: cross, decoder_self, encoder_self, self"
                )
            if not isinstance(counts, list) or any(not _is_int(c) or not 0 <= c <= self.heads for c in counts):
                raise ConfigError(
                    f"heads_per_layer[{kind!r}]: expected a list of head counts in [0, {self.heads}], got {counts!r}"
                )
            if self.key_value_heads != self.heads and kind != "cross" and kind not in (self.kv_groups or {}):
                raise ConfigError(
                    f"heads_per_layer[{kind!r}]: pruned grouped-query attention needs kv_groups[{kind!r}]"
                )

    def _check_kv_groups(self) -> None:
        for kind, layers in (self.kv_groups or {}).items():
            counts = (self.heads_per_layer or {}).get(kind)
            if counts is None:
                raise ConfigError(f"kv_groups[{kind!r}]: needs heads_per_layer[{kind!r}]")
            if not isinstance(layers, list) or len(layers) != len(counts):
                raise ConfigError(f"kv_groups[{kind!r}]: expected one list per layer ({len(counts)}), got {layers!r}")
            for layer, (groups, count) in enumerate(zip(layers, counts)):
                used = set(groups) if isinstance(groups, list) and all(_is_int(j) for j in groups) else None
                if used is None or len(groups) != count or used != set(range(len(used))):
                    raise ConfigError(
                        f"kv_groups[{kind!r}][{layer}]: expected {count} key/value head indices using 0..k-1, "
                        f"got {groups!r}"
                    )

    @property
    def cross_attention_layers(self) -> int:
        """Decoder layers that attend to an encoder's output (encoder-decoder attention), 0 where
        the model has no such decoder."""
        return 0

    @property
    def logits_per_position(self) -> int:
        """V, the width of the output layer at every position whose logits the training loss reads
        (the target vocabulary); 0 where the model predicts no token (a classifier's loss reads
        one row of labels per example, a sentence encoder has no output layer)."""
        return 0

    def kv_index_at(self, kind: str, layer: int) -> list[int] | None:
        """The query -> key/value head map of a pruned grouped-query layer, or None (uniform)."""
        if self.kv_groups is None or kind not in self.kv_groups:
            return None
        return list(self.kv_groups[kind][layer])

    def heads_at(self, kind: str, layer: int) -> int:
        """Heads of the attention module of ``kind`` in ``layer`` (``heads`` unless pruned)."""
        if self.heads_per_layer is None or kind not in self.heads_per_layer:
            return self.heads
        counts = self.heads_per_layer[kind]
        if layer >= len(counts):
            raise ConfigError(f"heads_per_layer[{kind!r}] lists {len(counts)} layers, layer {layer} is missing")
        return counts[layer]

    # ---- derived values -------------------------------------------------------------------

    @property
    def head_dim_k(self) -> int:
        return self.d_k if self.d_k is not None else self.d_model // self.heads

    @property
    def head_dim_v(self) -> int:
        return self.d_v if self.d_v is not None else self.head_dim_k

    @property
    def placement(self) -> str:
        """norm_placement, or ``pre`` / ``post`` from ``norm_first`` where it is None."""
        check_choice("qk_norm", self.qk_norm, QK_NORMS)
        if self.norm_placement is not None:
            return self.norm_placement
        return "pre" if self.norm_first else "post"

    @property
    def normalizer(self) -> str:
        return ATTENTION_NORMALIZERS[self.attention]

    @property
    def positional_width(self) -> int:
        return self.positional_dim if self.positional_dim is not None else self.d_model // 2

    # ---- conversion ------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls: type[C], data: Mapping[str, Any]) -> C:
        """Build from a mapping; an unknown key is a ``ValueError`` that lists the allowed keys, and
        a key of :data:`RETIRED_KEYS` (an older config's) is ignored."""
        data = {key: value for key, value in data.items() if key not in RETIRED_KEYS}
        allowed = cls.field_names()
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ConfigError(f"unknown key {unknown[0]!r} for {cls.__name__}; allowed: {', '.join(allowed)}")
        return cls(**data)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **dataclasses.asdict(self)}

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)


# ---- validation helpers ----------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive(name: str, value: int) -> None:
    if value <= 0:
        raise ConfigError(f"{name}: must be a positive integer, got {value}")


def check_choice(name: str, value: str, allowed: Mapping[str, Any] | tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}: unknown {value!r}; allowed: {', '.join(sorted(allowed))}")


def check_layers_cap(name: str, value: int | None) -> None:
    """Refuse more than :data:`~attnlab.limits.MAX_LAYERS` layers before any is built (a config of
    10^12 layers would build them one by one)."""
    if value is not None and value > MAX_LAYERS:
        raise ConfigError(
            f"model.{name}: {value:,} layers, more than the cap of {MAX_LAYERS:,} (attnlab.limits.MAX_LAYERS); lower it"
        )
