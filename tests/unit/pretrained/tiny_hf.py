"""Tiny Hugging Face checkpoints of every family attnlab opens, built with transformers' own config
classes and ``save_pretrained`` (random weights, norms and biases moved away from their defaults),
beside a small byte-level BPE tokenizer.json: the test data of tests/unit/pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LAYERS, HEADS, D_MODEL = 2, 4, 32
_LLAMA_LIKE = {
    "hidden_size": D_MODEL,
    "intermediate_size": 48,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
_GEMMA = {**_LLAMA_LIKE, "head_dim": 8, "query_pre_attn_scalar": 16, "sliding_window": 4, "tie_word_embeddings": True}
SIZES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", _LLAMA_LIKE),
    "llama-rope-llama3": (
        "llama",
        {
            **_LLAMA_LIKE,
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "mistral": ("mistral", {**_LLAMA_LIKE, "sliding_window": 4}),
    "qwen2": ("qwen2", _LLAMA_LIKE),
    "qwen3": ("qwen3", {**_LLAMA_LIKE, "head_dim": 16}),
    "gemma2": ("gemma2", {**_GEMMA, "attn_logit_softcapping": 20.0, "final_logit_softcapping": 10.0}),
    "gemma3_text": ("gemma3_text", {**_GEMMA, "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo2": ("olmo2", _LLAMA_LIKE),
    "phi3": ("phi3", {**_LLAMA_LIKE, "partial_rotary_factor": 0.5, "original_max_position_embeddings": 64}),
    "gpt_neox": (
        "gpt_neox",
        {
            "hidden_size": D_MODEL,
            "intermediate_size": 48,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "max_position_embeddings": 64,
            "rotary_pct": 0.5,
            "use_parallel_residual": True,
            "tie_word_embeddings": False,
        },
    ),
    "gpt2": ("gpt2", {"n_embd": D_MODEL, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64}),
    "gpt_neo": (
        "gpt_neo",
        {
            "hidden_size": D_MODEL,
            "num_layers": LAYERS,
            "num_heads": HEADS,
            "max_position_embeddings": 64,
            "attention_types": [[["local", "global"], 1]],
            "window_size": 3,
        },
    ),
    "bloom": ("bloom", {"hidden_size": D_MODEL, "n_layer": LAYERS, "n_head": HEADS}),
    "bloom-6-heads": ("bloom", {"hidden_size": 36, "n_layer": LAYERS, "n_head": 6}),
}
"""A family's test name -> (its ``model_type``, the tiny sizes of its transformers config; the
classes come from AutoConfig). Each mechanism of the family is switched on: windows shorter than
the test texts, soft caps, partial rotary, GQA, a head size that is not d_model / H."""

TEXTS = ["hello world, the quick brown fox", "def f(x): return x + 1", "12 34"]
VARIED = ["Hello, world!", "def f(x):\n    return x ** 2  # code", "3.14159 and 2718", "Ünïcödé ✓ 日本語", "  spaces  "]


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ bos_token }}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ bos_token }}assistant:{% endif %}"
)


def save_tokenizer(folder: Path) -> int:
    """A byte-level BPE tokenizer.json (BOS put before each text), saved into ``folder``; its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS * 20 + VARIED * 5, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(folder)
    return tokenizer.get_vocab_size()


def shift_vectors(model: Any) -> None:
    """Every 1-D parameter (norms' gains and biases) moved by N(0, 0.2) noise, away from the 1 and 0
    they start at, so that a test sees them applied."""
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(torch.randn_like(parameter) * 0.2)


def build(name: str, folder: Path) -> Any:
    """A random transformers model of family ``name`` (:data:`SIZES`) saved into ``folder``; returned in float64."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = save_tokenizer(folder)
    model_type, sizes = SIZES[name]
    config = AutoConfig.for_model(model_type, vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **sizes)
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    shift_vectors(model)
    model.save_pretrained(folder)
    return model.double().eval()
