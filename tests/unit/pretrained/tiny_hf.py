"""Tiny Hugging Face checkpoints of every family attnlab opens, built with transformers' own config
classes and ``save_pretrained`` (random weights, norms and biases moved away from their defaults),
beside a small byte-level BPE tokenizer.json: the test data of tests/unit/pretrained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LAYERS, HEADS, D_MODEL = 2, 4, 32
SIZES: dict[str, dict[str, Any]] = {
    "llama": {
        "hidden_size": D_MODEL,
        "intermediate_size": 48,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    },
    "gpt2": {"n_embd": D_MODEL, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 64},
}
"""model_type -> the tiny sizes of its transformers config (the classes come from AutoConfig)."""

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


def build(model_type: str, folder: Path) -> Any:
    """A random transformers model of ``model_type`` saved into ``folder``; returned in float64."""
    from transformers import AutoConfig, AutoModelForCausalLM

    vocab = save_tokenizer(folder)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **SIZES[model_type]
    )
    torch.manual_seed(sum(map(ord, model_type)))
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:  # norms' gains and biases, away from 1 and 0
                parameter.add_(torch.randn_like(parameter) * 0.2)
    model.save_pretrained(folder)
    return model.double().eval()
