"""The model, in pure PyTorch: tensors in, tensors out. No files, tokenizers or tasks.

Imports point down only: nothing here imports from attnlab outside ``attnlab.nn`` but
``attnlab.kernels``, the CPU-speed machinery behind a few calls (GEMM kernels of the linear maps,
dropout's masks, soft attention of short heads), which computes the same functions faster.
"""

from attnlab.nn.attention import NORMALIZERS, attention
from attnlab.nn.config import TransformerConfig
from attnlab.nn.decoding import DecodingState, EncodedSource
from attnlab.nn.embedding import InputEmbedding, TokenTypes
from attnlab.nn.feed_forward import ACTIVATIONS, PositionwiseFeedForward
from attnlab.nn.head_masks import (
    ATTENTION_KINDS,
    HeadMask,
    check_head_mask,
    expert_mask_shape,
    full_head_mask,
    masking_experts,
    masking_heads,
)
from attnlab.nn.hooks import Site, add_hook, model_sites
from attnlab.nn.kv_cache import KVCache
from attnlab.nn.layers import AddNorm, DecoderLayer, DecoderLayerCache, EncoderLayer
from attnlab.nn.masks import (
    causal_mask,
    check_mask,
    combine_masks,
    lengths_to_padding_mask,
    padding_mask,
    sliding_window_mask,
)
from attnlab.nn.model_configs import (
    PRESETS,
    DecoderOnlyConfig,
    EncoderClassifierConfig,
    EncoderDecoderConfig,
    EncoderOnlyConfig,
    preset,
)
from attnlab.nn.models import (
    MODELS,
    DecoderOnly,
    EncoderClassifier,
    EncoderDecoder,
    EncoderOnly,
    TransformerModel,
    build_model,
    build_model_to_load,
    mean_pool,
    optional_state_keys,
)
from attnlab.nn.multi_head import MultiHeadAttention
from attnlab.nn.positional import POSITIONAL, make_positional, sinusoidal_table
from attnlab.nn.scores import SCORES, make_score
from attnlab.nn.stacks import Decoder, Encoder
from attnlab.nn.trace import trace

# What a user needs: the models and their configs, the attention blocks, masks, the hook mechanism.
# The other names imported above are for attnlab's own modules (loading weights, decoding state,
# the registries of choices); they stay importable by name but are not the public API.
__all__ = [
    # models and configs
    "EncoderDecoder",
    "EncoderClassifier",
    "DecoderOnly",
    "EncoderOnly",
    "TransformerModel",
    "TransformerConfig",
    "EncoderDecoderConfig",
    "EncoderClassifierConfig",
    "DecoderOnlyConfig",
    "EncoderOnlyConfig",
    "preset",
    "build_model",
    # the blocks
    "attention",
    "MultiHeadAttention",
    "KVCache",
    "PositionwiseFeedForward",
    "EncoderLayer",
    "DecoderLayer",
    "sinusoidal_table",
    # masks: boolean, True = may attend
    "causal_mask",
    "sliding_window_mask",
    "padding_mask",
    "lengths_to_padding_mask",
    "combine_masks",
    # observing and intervening: named sites, hooks, the head mask
    "model_sites",
    "Site",
    "add_hook",
    "trace",
    "masking_heads",
    "masking_experts",
    "expert_mask_shape",
    "HeadMask",
    "full_head_mask",
]
