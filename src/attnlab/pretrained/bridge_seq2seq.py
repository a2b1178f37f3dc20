"""The bridge for encoder-decoders: any sequence-to-sequence model transformers runs (T5, BART,
Marian, mBART, Pegasus, ...) with the named sites of attnlab's own :class:`~attnlab.nn.EncoderDecoder`.

Where a folder's ``model_type`` is in transformers' seq2seq mapping,
:mod:`attnlab.pretrained.hf_model` opens it with ``AutoModelForSeq2SeqLM`` (local files only, never
remote code: :func:`attnlab.pretrained.bridge.load_transformers_model`) and :class:`BridgedSeq2Seq`
gives it the three attention kinds of Vaswani §3.2.3, each with the sites of
:mod:`attnlab.nn.hooks`, through the same parts as the causal bridge
(:mod:`attnlab.pretrained.bridge_sites`)::

    encoder.L.attn.*     encoder self-attention           kind encoder_self
    decoder.L.attn.*     masked decoder self-attention    kind decoder_self
    decoder.L.cross.*    encoder-decoder attention        kind cross (queries from the decoder,
                                                          keys and values from the encoder output)

with ``encoder.embed`` / ``decoder.embed``, ``STACK.L.resid_pre/post`` (and ``resid_mid`` where the
layer adds its self-attention's output to its input as it is), ``STACK.L.ffn.*`` where the layer
has a feed-forward module, ``encoder.final_norm`` (the encoder's output, the memory every
cross-attention reads), ``decoder.final_norm`` (the unembedding's input) and ``logits``. Head
masks xi have the three kinds, so head importance splits by attention kind as Michel et al.'s
Table 2 / Figure 3 does.

Which module plays which part is found by the same probe as the causal bridge (one forward pass
watching the attention calls): the first attention module a decoder layer calls is its
self-attention, the second its cross-attention; nothing is chosen by ``model_type``.

Shape:
    src: (B, T_src) ids (padding: ``pad_id``);  tgt_in: (B, T_tgt), the target shifted right (the
    decoder's start id first);  returns logits (B, T_tgt, V).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from attnlab.errors import ConfigError
from attnlab.nn import EncodedSource, EncoderDecoderConfig, TransformerModel
from attnlab.pretrained.bridge import BridgedState, _probe_layers, attach_sites, find_residual_sums, input_device
from attnlab.pretrained.bridge_sites import BridgedEmbedding, BridgedStack, use_bridged_attention

__all__ = ["BridgedSeq2Seq"]


class BridgedSeq2Seq(TransformerModel):
    """A transformers encoder-decoder with attnlab's named sites (see the module docstring).

    Attention kinds: ``encoder_self``, ``decoder_self``, ``cross``.

    Attributes:
        hf: transformers' model (its parameters are this module's).
        encoder, decoder: the :class:`~attnlab.pretrained.bridge_sites.BridgedStack` of sites.
        config: an :class:`~attnlab.nn.EncoderDecoderConfig` of the sizes the probe saw (the head
            count of each kind and layer in ``heads_per_layer`` where they differ).
        lm_head: transformers' unembedding (``get_output_embeddings()``).
    """

    bridged = True
    norm_form = "measured"
    additive: bool
    """Whether each layer's output is its input plus its attention parts' and FFN's outputs."""

    def __init__(self, hf: nn.Module, *, pad_id: int = 0) -> None:
        super().__init__()
        self.hf = hf
        head = hf.get_output_embeddings()
        encoder, decoder = hf.get_encoder(), hf.get_decoder()
        if head is None or encoder is None or decoder is None:
            raise ConfigError(f"{type(hf).__name__}: no encoder, decoder and output embeddings attnlab can read")
        self._cache_argument = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        device = input_device(hf)
        src = torch.ones((1, 5), dtype=torch.long, device=device)
        tgt = torch.ones((1, 3), dtype=torch.long, device=device)  # another length: cross-attention's T_q != T_k
        (enc_layers, enc_calls), (dec_layers, dec_calls) = _probe_layers(
            hf, {"input_ids": src, "decoder_input_ids": tgt}, [encoder, decoder]
        )
        d_model = int(head.weight.shape[1])
        attach_sites(hf, enc_layers, enc_calls, d_model, cross=False)
        attach_sites(hf, dec_layers, dec_calls, d_model, cross=True)
        source_embedding, target_embedding = _embedding(encoder), _embedding(decoder)
        if source_embedding is target_embedding:
            raise ConfigError(f"{type(hf).__name__}: its encoder and decoder call one embedding module")
        self.encoder = BridgedStack(BridgedEmbedding(source_embedding), enc_layers, output_of=encoder)
        self.decoder = BridgedStack(BridgedEmbedding(target_embedding), dec_layers, head)
        counts = {
            "encoder_self": [layer.self_attn.heads for layer in enc_layers],
            "decoder_self": [layer.self_attn.heads for layer in dec_layers],
            "cross": [layer.cross_attn.heads for layer in dec_layers],
        }
        heads = max(max(c) for c in counts.values())
        d_v = enc_layers[0].self_attn.d_v
        text = hf.config
        self.config = EncoderDecoderConfig(
            vocab_size=int(source_embedding.weight.shape[0]),
            tgt_vocab_size=int(head.weight.shape[0]),
            layers=len(enc_layers),
            decoder_layers=len(dec_layers),
            d_model=d_model,
            heads=heads,
            d_k=d_v,
            d_v=d_v,
            d_ff=int(getattr(text, "d_ff", None) or getattr(text, "decoder_ffn_dim", None) or 4 * d_model),
            positional="none",
            max_len=int(getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None) or 512),
            norm_first=True,
            dropout=0.0,
            attention_dropout=0.0,
            pad_id=pad_id,
            heads_per_layer=None if all(c == heads for v in counts.values() for c in v) else counts,
        )
        self._memory_class: Any = None
        find_residual_sums(self)  # its forward pass encodes once: _memory_class is the encoder's output class

    @property
    def lm_head(self) -> nn.Module:
        return self.hf.get_output_embeddings()

    def forward(self, src: Tensor, tgt_in: Tensor) -> Tensor:
        return self.decode(tgt_in, self.encode(src))

    def encode(self, src: Tensor) -> EncodedSource:
        """The encoder's output for ``src`` (its padding, ``pad_id``, masked)."""
        is_token = src != self.config.pad_id
        out = self.hf.get_encoder()(input_ids=src, attention_mask=is_token.long())
        self._memory_class = type(out)  # what the decoder reads it as (a mixture of experts' has router logits)
        return EncodedSource(out[0], is_token)

    def decode(self, tgt_in: Tensor, memory: EncodedSource, *, state: BridgedState | None = None) -> Tensor:
        """Logits for ``tgt_in`` reading ``memory``; with ``state`` (from :meth:`new_state`) only
        the new positions, the keys and values so far in transformers' cache."""
        inputs: dict[str, Any] = {
            "encoder_outputs": self._memory_class(last_hidden_state=memory.states),
            "attention_mask": memory.is_token.long(),
            "decoder_input_ids": tgt_in,
            "use_cache": state is not None,
        }
        if state is not None:
            state.advance(torch.ones(tgt_in.shape, dtype=torch.bool, device=tgt_in.device))
            inputs[self._cache_argument] = state.cache
        out = self.hf(**inputs)
        if state is not None:
            state.cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return self._logits(out.logits)

    def new_state(self) -> BridgedState:
        return BridgedState()

    def use_attention(self, setting: str) -> None:
        """transformers' SDPA path (``auto``, ``sdpa``) or attnlab's explicit formula (``explicit``)."""
        use_bridged_attention(self, setting)

    def site_stacks(self) -> dict[str, tuple[Any, tuple[str, ...]]]:
        return {"encoder": (self.encoder, ("encoder_self",)), "decoder": (self.decoder, ("decoder_self", "cross"))}

    def example_inputs(self, length: int) -> tuple[Tensor, ...]:
        token = 1 if self.config.pad_id != 1 else 2
        tokens = torch.full((1, length), token, device=input_device(self.hf))
        return tokens, tokens  # a source and a target of the same length


def _embedding(stack: nn.Module) -> nn.Module:
    """A stack's token embedding module."""
    module = getattr(stack, "embed_tokens", None)
    return module if isinstance(module, nn.Module) else stack.get_input_embeddings()
