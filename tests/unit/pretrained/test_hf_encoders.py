"""BERT and RoBERTa folders open directly (no import step) and equal transformers' encoders in
float64: last hidden states of a right-padded batch, the tokenizer's ids with the model's own
framing ([CLS] ... [SEP], <s> ... </s>), and RoBERTa's position table offset past its padding id."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from attnlab.pretrained.sources import open_model
from tests.unit.pretrained.tiny_hf import shift_vectors

pytest.importorskip("transformers")

TEXTS = ["hello world, the quick brown fox", "def f(x): return x + 1", "12 34"]
SPECIALS = {"bert": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "roberta": ["<s>", "<pad>", "</s>", "<unk>"]}


def _save_tokenizer(model_type: str, folder: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIALS[model_type][-1] if model_type == "roberta" else "[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS[model_type], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(TEXTS * 20, trainer)
    if model_type == "roberta":
        tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0), add_prefix_space=False)
        names = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "cls_token": "<s>", "sep_token": "</s>"}
    else:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
        names = {"pad_token": "[PAD]", "cls_token": "[CLS]", "sep_token": "[SEP]", "unk_token": "[UNK]"}
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, **names).save_pretrained(folder)
    return tokenizer.get_vocab_size()


@pytest.fixture(scope="module", params=["bert", "roberta"])
def encoder(request, tmp_path_factory) -> tuple[str, Path, Any]:  # noqa: ANN001
    from transformers import AutoConfig, AutoModel

    model_type, folder = request.param, tmp_path_factory.mktemp(request.param)
    vocab = _save_tokenizer(model_type, folder)
    pad = 1 if model_type == "roberta" else 0
    config = AutoConfig.for_model(
        model_type,
        vocab_size=vocab,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=64 + (pad + 1 if model_type == "roberta" else 0),
        pad_token_id=pad,
        type_vocab_size=1 if model_type == "roberta" else 2,
    )
    torch.manual_seed(3)
    model = AutoModel.from_config(config, add_pooling_layer=False)
    shift_vectors(model)
    model.save_pretrained(folder)
    return model_type, folder, model.double().eval()


def test_the_last_hidden_states_equal_the_reference(encoder) -> None:  # noqa: ANN001
    _, folder, reference = encoder
    loaded = open_model(folder, dtype="float64")
    assert loaded.run is None and loaded.experiment.model_kind == "encoder"
    rows = [loaded.task.encode(t) for t in TEXTS]
    width = max(map(len, rows))
    pad = loaded.task.pad_id
    tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    is_token = tokens != pad
    with torch.no_grad():
        expected = reference(tokens, attention_mask=is_token.long()).last_hidden_state
        got = loaded.model(tokens)
    torch.testing.assert_close(got[is_token], expected[is_token])


def test_token_ids_equal_autotokenizer_with_the_models_framing(encoder) -> None:  # noqa: ANN001
    from transformers import AutoTokenizer

    _, folder, _ = encoder
    loaded = open_model(folder)
    reference = AutoTokenizer.from_pretrained(folder)
    for text in TEXTS:
        assert loaded.task.encode(text) == reference(text).input_ids
