"""The models every benchmark shares, built at the same sizes in each system.

The ``train`` model of the issue: an encoder-decoder with d_model 256, 8 heads, 3 + 3 layers,
d_ff 1024, a 1000-token vocabulary, batch 32, source and target length 64, fp32. ``quick`` sizes
are small enough for a smoke test.

Systems:
* attnlab's :class:`attnlab.nn.EncoderDecoder`;
* ``torch.nn.Transformer`` with token embeddings and an output layer;
* Hugging Face ``BartForConditionalGeneration``, randomly initialised at the same sizes, with the
  ``sdpa`` attention implementation (needs the optional ``transformers``: ``pip install attnlab[bench]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attnlab.nn import EncoderDecoder, EncoderDecoderConfig
from attnlab.tasks.batching import Batch

__all__ = [
    "Sizes",
    "FULL",
    "QUICK",
    "attnlab_model",
    "TorchTransformerSeq2Seq",
    "hf_bart",
    "random_batch",
    "hf_available",
]


@dataclass(frozen=True)
class Sizes:
    d_model: int
    heads: int
    layers: int
    d_ff: int
    vocab: int
    batch: int
    length: int
    dropout: float = 0.1


FULL = Sizes(d_model=256, heads=8, layers=3, d_ff=1024, vocab=1000, batch=32, length=64)
QUICK = Sizes(d_model=64, heads=4, layers=2, d_ff=128, vocab=200, batch=8, length=16)


def attnlab_model(sizes: Sizes) -> EncoderDecoder:
    return EncoderDecoder(
        EncoderDecoderConfig(
            vocab_size=sizes.vocab,
            layers=sizes.layers,
            d_model=sizes.d_model,
            heads=sizes.heads,
            d_ff=sizes.d_ff,
            dropout=sizes.dropout,
            max_len=max(512, 4 * sizes.length),
        )
    )


class TorchTransformerSeq2Seq(nn.Module):
    """``torch.nn.Transformer`` plus source/target embeddings and the output layer.

    Its ``dropout`` argument also drops attention weights and FFN activations; those two are
    switched off here, so that it drops what attnlab and BART drop (sub-layer outputs; Vaswani
    §5.4) and does the same work: 17 dropouts on (B, T, d_model), the embeddings' included, rather
    than 30 calls over 3.4x the entries, and fused attention rather than the explicit path that
    attention dropout forces. (It has no positional encoding: a few additions less.)
    """

    def __init__(self, sizes: Sizes) -> None:
        super().__init__()
        self.source_embedding = nn.Embedding(sizes.vocab, sizes.d_model)
        self.target_embedding = nn.Embedding(sizes.vocab, sizes.d_model)
        self.transformer = nn.Transformer(
            sizes.d_model, sizes.heads, sizes.layers, sizes.layers, sizes.d_ff, dropout=sizes.dropout, batch_first=True
        )
        for layer in [*self.transformer.encoder.layers, *self.transformer.decoder.layers]:
            layer.dropout = nn.Identity()  # inside the FFN
            for attention in (layer.self_attn, getattr(layer, "multihead_attn", None)):
                if attention is not None:
                    attention.dropout = 0.0  # on the attention weights
        self.embedding_dropout = nn.Dropout(sizes.dropout)
        self.output = nn.Linear(sizes.d_model, sizes.vocab)

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt_in.shape[1], device=tgt_in.device)
        source, target = (
            self.embedding_dropout(e) for e in (self.source_embedding(src), self.target_embedding(tgt_in))
        )
        hidden = self.transformer(source, target, tgt_mask=mask, tgt_is_causal=True)
        return self.output(hidden)


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def hf_bart(sizes: Sizes) -> nn.Module:
    """BART at the same sizes (ReLU FFN like the others), random weights, sdpa attention."""
    from transformers import BartConfig, BartForConditionalGeneration  # the optional [bench] extra

    config = BartConfig(
        vocab_size=sizes.vocab,
        d_model=sizes.d_model,
        encoder_layers=sizes.layers,
        decoder_layers=sizes.layers,
        encoder_attention_heads=sizes.heads,
        decoder_attention_heads=sizes.heads,
        encoder_ffn_dim=sizes.d_ff,
        decoder_ffn_dim=sizes.d_ff,
        max_position_embeddings=max(512, 4 * sizes.length),
        dropout=sizes.dropout,
        attention_dropout=0.0,
        activation_dropout=0.0,
        activation_function="relu",
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        forced_eos_token_id=None,
        forced_bos_token_id=None,
    )
    return BartForConditionalGeneration._from_config(config, attn_implementation="sdpa")


def random_batch(sizes: Sizes, *, seed: int = 0) -> Batch:
    """A full batch of random tokens (ids 3.., no padding), target shifted right behind BOS = 1."""
    generator = torch.Generator().manual_seed(seed)
    src = torch.randint(3, sizes.vocab, (sizes.batch, sizes.length), generator=generator)
    target = torch.randint(3, sizes.vocab, (sizes.batch, sizes.length), generator=generator)
    tgt_in = torch.cat([torch.ones(sizes.batch, 1, dtype=torch.long), target[:, :-1]], dim=1)
    is_token = torch.ones(sizes.batch, sizes.length, dtype=torch.bool)
    return Batch(
        lengths=torch.full((sizes.batch,), sizes.length),
        src=src,
        src_is_token=is_token,
        tgt_in=tgt_in,
        tgt_out=target,
        tgt_is_token=is_token,
    )
