"""A tiny random Llama whose tokenizer keeps the names of docs/notebook.md's IOI study whole (a
byte-level BPE trained on its prompts, a BOS before each text), with the 10 layers x 7 heads that
the study's head 9.6 needs: the study runs on it as written, in seconds."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = [
    "When Mary and John went to the store, John gave a drink to Mary",
    "When Tom and James went to the park, James gave a ball to Tom",
    "When Mary and John went to the store, Mary gave a drink to John",
    "When Tom and James went to the park, Tom gave a ball to James",
]


def ioi_llama(folder: Path) -> Path:
    """Write the model and its tokenizer into ``folder``; returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", "<pad>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(PROMPTS * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    wrapped.save_pretrained(folder)
    config = LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=28,
        intermediate_size=40,
        num_hidden_layers=10,
        num_attention_heads=7,
        num_key_value_heads=7,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(49)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights than the initialisation, so heads differ
        for parameter in model.parameters():
            parameter.normal_(1.0 if parameter.dim() == 1 else 0.0, 0.2)
    model.save_pretrained(folder)
    return folder
