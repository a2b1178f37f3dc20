"""Importing BERT checkpoints: the same function as Hugging Face, and errors that name the culprit."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from attnlab.errors import CheckpointError, ConfigError, UsageError
from attnlab.nn import EncoderOnly, EncoderOnlyConfig, mean_pool
from attnlab.pretrained.bert import find_source, import_bert
from attnlab.pretrained.encoder_families import model_section
from attnlab.run.loaded import open_run
from attnlab.run.verification import verify_run
from tests.unit.pretrained.tiny_bert import transformers, write_tiny_bert

TEXTS = ["the cat sat on the mat.", "A big red house!", "they runs fast, not slow?", "cafe", "zebra xylophone 42"]


def _hf_outputs(folder, texts):
    tokenizer = transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=True)
    model = transformers.BertModel.from_pretrained(folder, local_files_only=True).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    return tokenizer, batch, hidden


@pytest.mark.parametrize("head", [False, True], ids=["BertModel", "BertForMaskedLM-prefixed"])
def test_imported_model_equals_hugging_face(tmp_path, head):
    folder = write_tiny_bert(tmp_path / "src", head=head)
    imported = import_bert(find_source(folder), tmp_path / "run")
    loaded = open_run(tmp_path / "run")
    if head:  # the masked-LM head is skipped; the encoder is the same as BertModel's
        folder = write_tiny_bert(tmp_path / "plain", head=False)
        save_file(
            {
                k.removeprefix("bert."): v
                for k, v in load_file(tmp_path / "src" / "model.safetensors").items()
                if k.startswith("bert.")
            },
            folder / "model.safetensors",
            metadata={"format": "pt"},
        )
        assert any(name.startswith("cls.") for name in imported.skipped)
    tokenizer, batch, reference = _hf_outputs(folder, TEXTS)
    for text, ids, mask in zip(TEXTS, batch["input_ids"], batch["attention_mask"], strict=True):
        assert loaded.codec.encode(text) == ids[mask.bool()].tolist()
    assert bool((batch["attention_mask"] == 0).any())  # the batch really is padded
    with torch.no_grad():
        ours = loaded.model(batch["input_ids"])
    real = batch["attention_mask"].bool()
    assert (ours - reference)[real].abs().max() < 1e-5
    assert (mean_pool(ours, real) - mean_pool(reference, real)).abs().max() < 1e-5


def test_token_types_match_hugging_face(tmp_path):
    folder = write_tiny_bert(tmp_path / "src")
    import_bert(find_source(folder), tmp_path / "run")
    model = open_run(tmp_path / "run").model
    hf = transformers.BertModel.from_pretrained(folder, local_files_only=True).eval()
    ids = torch.tensor([[2, 5, 6, 3, 7, 8, 3]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    with torch.no_grad():
        expected = hf(input_ids=ids, token_type_ids=types).last_hidden_state
        assert (model(ids, token_types=types) - expected).abs().max() < 1e-5
        assert (model(ids, token_types=types) - model(ids)).abs().max() > 1e-3  # types do matter


def test_run_config_is_a_post_ln_gelu_encoder_with_the_checkpoint_eps(tmp_path):
    import_bert(find_source(write_tiny_bert(tmp_path / "src", layer_norm_eps=1e-7)), tmp_path / "run")
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    model = config["model"]
    assert config["task"]["name"] == "sentences"
    assert (model["kind"], model["norm_first"], model["activation"], model["positional"]) == (
        "encoder",
        False,
        "gelu",
        "learned",
    )
    assert (model["type_vocab_size"], model["embedding_norm"], model["scale_embeddings"]) == (2, True, False)
    assert model["layer_norm_eps"] == 1e-7
    report = verify_run(tmp_path / "run")  # the import wrote the run's manifest with its files
    assert report.ok and not report.warnings
    listed = ["manifest.json", "config.json", "tokenizer.json", "model.safetensors", "provenance.json"]
    assert [c.path for c in report.files] == listed


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("position_embedding_type", "relative_key"),
        ("hidden_act", "swish"),
        ("model_type", "distilbert"),
        ("is_decoder", True),
    ],
)
def test_unsupported_config_field_is_named(field, value):
    config = {
        "hidden_size": 8,
        "num_attention_heads": 2,
        "num_hidden_layers": 1,
        "intermediate_size": 8,
        "max_position_embeddings": 8,
        field: value,
    }
    with pytest.raises(ConfigError, match=field):
        model_section(config)


_VALID = {
    "hidden_size": 8,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "intermediate_size": 8,
    "max_position_embeddings": 8,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
        ({"num_attention_heads": -2}, "num_attention_heads must be an integer >= 1, got -2"),
        ({"num_attention_heads": 3}, "hidden_size 8 is not divisible by num_attention_heads 3"),
        ({"hidden_size": "8"}, "hidden_size must be an integer >= 1, got '8'"),
        ({"num_hidden_layers": 1.5}, "num_hidden_layers must be an integer >= 1, got 1.5"),
        ({"intermediate_size": True}, "intermediate_size must be an integer >= 1, got True"),
        ({"max_position_embeddings": None}, "max_position_embeddings must be an integer >= 1, got None"),
        ({"type_vocab_size": -1}, "type_vocab_size must be an integer >= 0, got -1"),
        ({"hidden_dropout_prob": 1.5}, r"hidden_dropout_prob must be a number in \[0, 1\), got 1.5"),
        ({"layer_norm_eps": 0}, "layer_norm_eps must be a positive number, got 0"),
        ({"hidden_size": None, "drop": "hidden_size"}, "missing 'hidden_size'"),
    ],
)
def test_invalid_config_values_name_the_file_and_key(change, message):
    config = {**_VALID, **{k: v for k, v in change.items() if k != "drop"}}
    config.pop(change.get("drop", ""), None)
    with pytest.raises(ConfigError, match=f"^bert/config.json: {message}$"):
        model_section(config, "bert/config.json")


def test_import_of_zero_heads_names_the_file(tmp_path):
    folder = write_tiny_bert(tmp_path / "src")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    with pytest.raises(
        ConfigError, match=f"{folder / 'config.json'}: num_attention_heads must be an integer >= 1, got 0"
    ):
        import_bert(find_source(folder), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_shape_mismatch_names_the_tensor(tmp_path):
    folder = write_tiny_bert(tmp_path / "src")
    tensors = load_file(folder / "model.safetensors")
    name = "encoder.layer.1.attention.self.key.weight"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + r".*shape \(24, 23\)"):
        import_bert(find_source(folder), tmp_path / "run")


def test_missing_and_unknown_tensors_are_named(tmp_path):
    folder = write_tiny_bert(tmp_path / "src")
    tensors = load_file(folder / "model.safetensors")
    del tensors["encoder.layer.0.output.dense.bias"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"encoder\.layer\.0\.output\.dense\.bias"):
        import_bert(find_source(folder), tmp_path / "run")
    tensors = load_file(write_tiny_bert(tmp_path / "src2") / "model.safetensors")
    tensors["encoder.layer.0.attention.self.distance_embedding.weight"] = torch.zeros(3, 24)
    save_file(tensors, tmp_path / "src2" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="distance_embedding"):
        import_bert(find_source(tmp_path / "src2"), tmp_path / "run2")


def test_source_folder_errors(tmp_path):
    with pytest.raises(UsageError, match="not a folder"):
        find_source(tmp_path / "nothing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="config.json"):
        find_source(tmp_path / "empty")


def test_sentence_transformers_layout_is_found_one_folder_down(tmp_path):
    write_tiny_bert(tmp_path / "st" / "0_Transformer")
    (tmp_path / "st" / "1_Pooling").mkdir()
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": True}))
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 16}))
    source = find_source(tmp_path / "st")
    assert source.folder.name == "0_Transformer" and source.pooling == "first" and source.max_tokens == 16
    import_bert(source, tmp_path / "run")
    loaded = open_run(tmp_path / "run")
    ids = loaded.codec.encode(" ".join(["cat"] * 40))
    assert len(ids) == 16 and ids[0] == loaded.task.bos_id and ids[-1] == loaded.task.eos_id  # cut, [SEP] kept


@pytest.mark.parametrize(
    "switches,pooling",
    [
        ({"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}, "mean"),
        ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "first"),
        (
            {"pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": True},
            "pooling_mode_mean_tokens, pooling_mode_max_tokens",
        ),
        (
            {"pooling_mode_cls_token": True, "pooling_mode_mean_sqrt_len_tokens": True},
            "pooling_mode_cls_token, pooling_mode_mean_sqrt_len",
        ),
        ({"pooling_mode_max_tokens": True}, "this model has pooling_mode_max_tokens"),
        ({"pooling_mode_lasttoken": True}, "this model has pooling_mode_lasttoken"),
        ({"pooling_mode_mean_tokens": False}, "this model has none"),
    ],
)
def test_pooling_other_than_one_mean_or_cls_is_refused(tmp_path, switches, pooling):
    """A concatenation of several poolings (or max, sqrt-length, last-token pooling) has no
    attnlab readout: refusing it beats silently keeping one of them."""
    write_tiny_bert(tmp_path / "st" / "0_Transformer")
    (tmp_path / "st" / "1_Pooling").mkdir()
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 24, **switches}))
    if pooling in ("mean", "first"):
        assert find_source(tmp_path / "st").pooling == pooling
    else:
        with pytest.raises(ConfigError, match=f"1_Pooling/config.json: attnlab supports exactly one of .*{pooling}"):
            find_source(tmp_path / "st")


@pytest.mark.parametrize("lower", [True, False])
def test_sentence_transformers_do_lower_case_lowercases_the_text_first(tmp_path, lower):
    """sentence-transformers lowercases every text before a cased tokenizer sees it."""
    folder = write_tiny_bert(tmp_path / "st" / "0_Transformer")
    (folder / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": False}))  # a cased tokenizer
    (tmp_path / "st" / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 16, "do_lower_case": lower})
    )
    import_bert(find_source(tmp_path / "st"), tmp_path / "run")
    codec = open_run(tmp_path / "run").codec
    cased = transformers.BertTokenizerFast(str(folder / "vocab.txt"), do_lower_case=False)
    text = "The Cat SAT on the mat."
    expected = cased(text.lower() if lower else text)["input_ids"]
    assert codec.encode(text) == expected
    assert (codec.encode(text) == codec.encode(text.lower())) == lower


def test_encoder_only_options_are_chosen_once():
    plain = EncoderOnly(EncoderOnlyConfig(vocab_size=20, layers=1, d_model=8, heads=2, d_ff=16))
    names = set(plain.state_dict())
    assert not any("token_type" in n or "embedding.norm" in n for n in names)  # old runs keep their weights
    bert_like = EncoderOnly(
        EncoderOnlyConfig(
            vocab_size=20,
            layers=1,
            d_model=8,
            heads=2,
            d_ff=16,
            type_vocab_size=2,
            embedding_norm=True,
            positional="learned",
            max_len=10,
        )
    )
    assert {"encoder.embedding.token_type.weight", "encoder.embedding.norm.weight"} <= set(bert_like.state_dict())
    with pytest.raises(ValueError, match="type_vocab_size"):
        EncoderOnlyConfig(type_vocab_size=-1)
