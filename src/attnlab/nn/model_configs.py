"""The four kinds of model's configurations, and what differs between them.

Each kind is a subclass of :class:`attnlab.nn.config.TransformerConfig` whose class attributes say
how it behaves where the kinds differ (``language_model``, ``reads_source_and_target``,
``predicts_class``, ``embeds_sentences``, ``throughput_key``, ``has_perplexity``,
``input_extra_positions``; :class:`~attnlab.nn.config.TransformerConfig` documents each), so callers
ask the config, never compare the kind's name.

Presets: ``tiny`` (tests), ``small``, and ``base``, the base model of Vaswani et al.
(N = 6, d_model = 512, h = 8, d_ff = 2048).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from attnlab.errors import ConfigError
from attnlab.nn.config import POOLINGS, TransformerConfig, check_choice, check_layers_cap, check_positive

__all__ = [
    "EncoderDecoderConfig",
    "EncoderClassifierConfig",
    "DecoderOnlyConfig",
    "EncoderOnlyConfig",
    "PRESETS",
    "preset",
]

C = TypeVar("C", bound=TransformerConfig)


@dataclass(frozen=True, kw_only=True)
class EncoderDecoderConfig(TransformerConfig):
    """An encoder-decoder for seq2seq (Vaswani §3.1).

    Attributes:
        tgt_vocab_size: target vocabulary size; default ``vocab_size`` (a shared vocabulary).
        decoder_layers: decoder layers; default ``layers``.
        tie_embeddings: share the target embedding with the output projection (Vaswani §3.4).
    """

    kind: ClassVar[str] = "encoder_decoder"
    reads_source_and_target: ClassVar[bool] = True

    tgt_vocab_size: int | None = None
    decoder_layers: int | None = None
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tgt_vocab_size", "decoder_layers"):
            if getattr(self, name) is not None:
                check_positive(name, getattr(self, name))
        check_layers_cap("decoder_layers", self.decoder_layers)
        _check_tie(self)
        if self.pad_id >= self.target_vocab_size:
            raise ConfigError(f"pad_id: must lie in [0, tgt_vocab_size={self.target_vocab_size}), got {self.pad_id}")

    @property
    def target_vocab_size(self) -> int:
        return self.tgt_vocab_size if self.tgt_vocab_size is not None else self.vocab_size

    @property
    def decoder_depth(self) -> int:
        return self.decoder_layers if self.decoder_layers is not None else self.layers

    @property
    def cross_attention_layers(self) -> int:
        return self.decoder_depth

    @property
    def logits_per_position(self) -> int:
        return self.target_vocab_size


@dataclass(frozen=True, kw_only=True)
class EncoderClassifierConfig(TransformerConfig):
    """An encoder with a classifier on one readout position (language recognition, Hahn §3).

    Attributes:
        num_classes: number of labels (2 for recognition: in / not in the language).
        pooling: ``eos`` reads the last non-padding position, after the end-of-sequence symbol
            (Hahn §3); ``first`` reads position 0 (a CLS token); ``mean`` averages real positions.
    """

    kind: ClassVar[str] = "encoder_classifier"
    predicts_class: ClassVar[bool] = True
    throughput_key: ClassVar[str] = "examples_per_s"
    has_perplexity: ClassVar[bool] = False

    num_classes: int = 2
    pooling: str = "eos"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_classes < 2:
            raise ConfigError(f"num_classes: must be >= 2, got {self.num_classes}")
        check_choice("pooling", self.pooling, POOLINGS)


@dataclass(frozen=True, kw_only=True)
class DecoderOnlyConfig(TransformerConfig):
    """A causal language model: encoder layers with masked self-attention.

    Attributes:
        tie_embeddings: share the token embedding with the output projection.
    """

    kind: ClassVar[str] = "decoder_only"
    language_model: ClassVar[bool] = True
    input_extra_positions: ClassVar[int] = 2

    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tie(self)

    @property
    def logits_per_position(self) -> int:
        return self.vocab_size


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyConfig(TransformerConfig):
    """An encoder that returns its last hidden states, as BERT does (a sentence encoder).

    A BERT-family checkpoint is this with ``positional='learned'``, ``scale_embeddings=False``,
    ``type_vocab_size=2``, ``embedding_norm=True``, ``activation='gelu'`` and post-LN layers.
    """

    kind: ClassVar[str] = "encoder"
    embeds_sentences: ClassVar[bool] = True
    has_perplexity: ClassVar[bool] = False
    input_extra_positions: ClassVar[int] = 0


PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"layers": 2, "d_model": 32, "heads": 4, "d_ff": 64},
    "small": {"layers": 3, "d_model": 256, "heads": 8, "d_ff": 1024},
    "base": {"layers": 6, "d_model": 512, "heads": 8, "d_ff": 2048},
}
"""Named sizes; ``base`` is the base Transformer of Vaswani et al. (Table 3)."""


def preset(name: str, config_cls: type[C] = EncoderDecoderConfig, **overrides: Any) -> C:  # type: ignore[assignment]
    """A config of class ``config_cls`` with the sizes of preset ``name``, then ``overrides``."""
    check_choice("preset", name, PRESETS)
    return config_cls(**{**PRESETS[name], **overrides})


def _check_tie(config: EncoderDecoderConfig | DecoderOnlyConfig) -> None:
    concatenated = config.positional_combine == "concat" and config.positional in ("sinusoidal", "learned")
    if config.tie_embeddings and concatenated:
        raise ConfigError("tie_embeddings: needs token vectors of width d_model, so not positional_combine='concat'")
