"""A small random BERT checkpoint written by Hugging Face ``transformers`` (no download)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers (the [dev] extra) is needed for BERT checkpoints"
)

WORDS = (
    "the cat dog sat on mat runs fast slow big small red blue house tree and of to in is was "
    "it he she they we you i not but or cafe one two three"
).split()
_VOCAB = (
    ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    + WORDS
    + [".", ",", "!", "?", "##s", "##ed", "##ing"]
    + list("abcdefghijklmnopqrstuvwxyz0123456789")
    + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
)

VOCAB = list(dict.fromkeys(_VOCAB))  # single letters double as words: keep the first of each

CONFIG = dict(
    vocab_size=len(VOCAB),
    hidden_size=24,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=40,
    max_position_embeddings=32,
    type_vocab_size=2,
    layer_norm_eps=1e-12,
    hidden_act="gelu",
    pad_token_id=0,
)


def write_tiny_bert(folder: Path, *, head: bool = False, seed: int = 0, **overrides) -> Path:
    """A BertModel (or BertForMaskedLM with ``head``: names prefixed ``bert.``) with vocab.txt."""
    import torch

    torch.manual_seed(seed)
    config = transformers.BertConfig(**{**CONFIG, **overrides})
    model = (transformers.BertForMaskedLM if head else transformers.BertModel)(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True}), encoding="utf-8")
    return folder
