"""The four models: EncoderDecoder, EncoderClassifier, DecoderOnly and EncoderOnly.

Each maps token ids to logits and nothing else: no loss, no tokenizer, no files. Each names its
stacks (:meth:`TransformerModel.site_stacks`), from which :mod:`attnlab.nn.hooks` names every site
that is read or changed: caching, editing and the head mask are all hooks on those sites.

* :class:`EncoderDecoder`: p(y_{1:L} | x_{1:T}) = prod_l p(y_l | y_{<l}, z_{1:T}) (Li's slides,
  "Transformer Architecture"; Vaswani §3.1). Training feeds the target shifted right (Agarwal §5.2).
* :class:`EncoderClassifier`: language recognition; the label is read from the last activation
  y_n^(L), after the end-of-sequence symbol (Hahn §3, "Formalizing Language Recognition").
* :class:`DecoderOnly`: a causal language model.
* :class:`EncoderOnly`: the last hidden states of an encoder (BERT-family sentence encoders).

Their parts: the input embedding (:mod:`attnlab.nn.embedding`), the stacks
(:mod:`attnlab.nn.stacks`), the positions their tokens take (:mod:`attnlab.nn.token_positions`)
and what decoding keeps between steps (:mod:`attnlab.nn.decoding`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial, wraps

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from attnlab.kernels import LinearKernel, calibration, linear_kernel
from attnlab.nn.config import TransformerConfig
from attnlab.nn.decoding import DecodingState, EncodedSource
from attnlab.nn.head_masks import head_mask_shapes
from attnlab.nn.hooks import Hook, Site, attention_sites, run_hooks
from attnlab.nn.kv_cache import KVCache
from attnlab.nn.layers import DecoderLayerCache
from attnlab.nn.model_configs import (
    DecoderOnlyConfig,
    EncoderClassifierConfig,
    EncoderDecoderConfig,
    EncoderOnlyConfig,
)
from attnlab.nn.multi_head import set_attention_backend
from attnlab.nn.scores import soft_cap
from attnlab.nn.stacks import Decoder, Encoder

__all__ = [
    "TransformerModel",
    "OutputLayer",
    "EncoderDecoder",
    "EncoderClassifier",
    "DecoderOnly",
    "EncoderOnly",
    "POOLINGS",
    "MODELS",
    "build_model_to_load",
    "build_model",
    "mean_pool",
    "optional_state_keys",
]


def _with_own_kernels(method: Callable) -> Callable:
    """``method`` run with the model's own kernel record active (:attr:`TransformerModel.kernel_record`;
    none: as it is): the model's call, and an encoder-decoder's ``encode`` / ``decode``, which
    decoding loops call directly."""

    @wraps(method)
    def run(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        record = self.kernel_record
        if record is None:
            return method(self, *args, **kwargs)
        with calibration.using(record):
            return method(self, *args, **kwargs)

    return run


class TransformerModel(nn.Module):
    """Base class: a model that names its stacks, whence its named sites (:mod:`attnlab.nn.hooks`)."""

    config: TransformerConfig
    has_logits_site: bool = True
    """Whether the model's output is the named site ``logits`` (not for an encoder-only model)."""
    logits_position_axis: int | None = 1
    """The positions' axis of ``logits``; None for one output per sequence (a classifier)."""
    has_pooled_site: bool = False
    """Whether the model pools its stack's output into the named site ``pooled`` (a classifier)."""

    kernel_record: calibration.KernelRecord | None = None
    """The kernels this model runs, shape class by shape class (:class:`attnlab.kernels.calibration.KernelRecord`):
    set when a run builds or loads it (a training run's ``fixed`` record by default, or the one its
    directory recorded); None: this process's measured choices. Every call of the model (and
    :meth:`EncoderDecoder.encode` / ``decode``) answers its kernel choices from it."""

    def __init__(self) -> None:
        super().__init__()
        self.hooks: dict[str, list[Hook]] = {}  # the sites logits and pooled (attnlab.nn.hooks)

    def use_attention(self, setting: str) -> None:
        """Run soft attention by ``setting`` (:data:`attnlab.nn.attention_backends.BACKEND_SETTINGS`)
        from now on: set on every attention module, once (:mod:`attnlab.nn.runtime_config`)."""
        set_attention_backend(self, setting)

    __call__ = _with_own_kernels(nn.Module.__call__)

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

    @_with_own_kernels
    def encode(self, src: Tensor) -> EncodedSource:
        return EncodedSource(self.encoder(src), src != self.config.pad_id)

    @_with_own_kernels
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
    saved weights by assignment (``attnlab.run.weights.load_tensors_into(..., assign=True)``), which puts
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
