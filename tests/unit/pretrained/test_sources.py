"""Opening any source: a Hugging Face folder (single file or shards), a name in the local Hugging
Face cache with its revisions, and every fault a user meets as one clear error; ``attnlab.load``'s
LanguageModel on top."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

import attnlab
from attnlab.errors import CheckpointError, ConfigError, UsageError
from attnlab.pretrained.checkpoint import find_checkpoint, hub_cache
from attnlab.pretrained.sources import open_model
from tests.unit.pretrained.tiny_hf import TEXTS, build

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[Path, object]:  # noqa: ANN001
    folder = tmp_path_factory.mktemp("llama")
    return folder, build("llama", folder)


def _copy(folder: Path, to: Path) -> Path:
    shutil.copytree(folder, to)
    return to


def _logits(source, **options) -> torch.Tensor:  # noqa: ANN001, ANN003
    loaded = open_model(source, dtype="float64", **options)
    with torch.no_grad():
        return loaded.model(torch.tensor([loaded.task.encode(TEXTS[0])]))


def test_sharded_weights_open_and_equal_the_single_file(llama, tmp_path) -> None:  # noqa: ANN001
    folder, reference = llama
    sharded = _copy(folder, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    reference.float().save_pretrained(sharded, max_shard_size="20KB")
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (sharded / "model.safetensors.index.json").is_file()
    torch.testing.assert_close(_logits(sharded), _logits(folder))


def test_a_missing_shard_or_a_misplaced_tensor_is_named(llama, tmp_path) -> None:  # noqa: ANN001
    folder, reference = llama
    sharded = _copy(folder, tmp_path / "sharded")
    (sharded / "model.safetensors").unlink()
    reference.float().save_pretrained(sharded, max_shard_size="20KB")
    index = sharded / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    shards = list(data["weight_map"].values())
    name, shard = next((n, s) for n, s in data["weight_map"].items() if shards.count(s) > 1)
    other = next(s for s in set(data["weight_map"].values()) if s != shard)
    data["weight_map"][name] = other
    index.write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=f"{name}.*not where model.safetensors.index.json puts it"):
        open_model(sharded)
    (sharded / other).unlink()
    with pytest.raises(CheckpointError, match=f"shard {other} is missing"):
        open_model(sharded)


@pytest.mark.parametrize("cut", [10, 5000])
def test_a_truncated_safetensors_file_is_named(llama, tmp_path, cut) -> None:  # noqa: ANN001
    folder, _ = llama
    broken = _copy(folder, tmp_path / "broken")
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) - cut] if cut > 100 else data[:cut])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        open_model(broken)


def test_weights_that_do_not_fit_config_json_are_named(llama, tmp_path) -> None:  # noqa: ANN001
    folder, _ = llama
    wrong = _copy(folder, tmp_path / "wrong")
    config = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.\w+_proj.weight \(\d+, \d+\) do not fit"):
        open_model(wrong)


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (
            {"model_type": "no_such_type"},
            ConfigError,
            "model_type 'no_such_type' is no causal language model or encoder-decoder",
        ),
        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, ConfigError, "rope_scaling type 'dynamic'"),
        ({"hidden_act": "relu"}, ConfigError, "hidden_act = 'relu' is not implemented"),
        ({"hidden_size": "wide"}, CheckpointError, "hidden_size must be a whole number"),
    ],
)
def test_a_config_attnlab_does_not_implement_is_one_error_naming_it(llama, tmp_path, change, error, words) -> None:  # noqa: ANN001
    folder, _ = llama
    changed = _copy(folder, tmp_path / "changed")
    config = json.loads((changed / "config.json").read_text())
    (changed / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(error, match=words.replace("(", r"\(")):
        open_model(changed)


def test_a_folder_without_config_json_or_weights_is_named(llama, tmp_path) -> None:  # noqa: ANN001
    folder, _ = llama
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("x")
    with pytest.raises((UsageError, CheckpointError), match="empty"):
        open_model(empty)
    weightless = _copy(folder, tmp_path / "weightless")
    (weightless / "model.safetensors").rename(weightless / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safetensors only"):
        open_model(weightless)


def _cache(tmp_path: Path, folder: Path, monkeypatch, commits=("0123abc", "4567def"), main="4567def") -> Path:  # noqa: ANN001
    """``ORG/tiny`` in a Hugging Face cache layout under ``tmp_path`` (two snapshots, refs/main)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    repo = hub_cache() / "models--org--tiny"
    for commit in commits:
        _copy(folder, repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(main)
    return repo


def test_a_name_in_the_cache_opens_its_revisions_offline(llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    folder, _ = llama
    repo = _cache(tmp_path, folder, monkeypatch)
    assert find_checkpoint("org/tiny").folder == repo / "snapshots" / "4567def"  # refs/main
    assert find_checkpoint("org/tiny", revision="0123").revision == "0123abc"  # a commit's first characters
    torch.testing.assert_close(_logits("org/tiny"), _logits(folder))
    with pytest.raises(UsageError, match="no revision 'v9'.*snapshots: 0123abc, 4567def"):
        find_checkpoint("org/tiny", revision="v9")


def test_a_name_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    with pytest.raises(UsageError, match=f"looked in {tmp_path / 'home' / 'hub' / 'models--org--absent'}"):
        open_model("org/absent")


def test_options_that_do_not_apply_to_the_source_are_refused(llama) -> None:  # noqa: ANN001
    folder, _ = llama
    with pytest.raises(UsageError, match="--checkpoint"):
        open_model(folder, checkpoint="last")
    with pytest.raises(UsageError, match="--revision"):
        open_model(folder, revision="main")
    with pytest.raises(UsageError, match="--dtype: unknown 'float8'"):
        open_model(folder, dtype="float8")


def test_weights_keep_their_stored_dtype_unless_asked(llama, tmp_path) -> None:  # noqa: ANN001
    folder, reference = llama
    stored = _copy(folder, tmp_path / "bf16")
    (stored / "model.safetensors").unlink()
    copy.deepcopy(reference).to(torch.bfloat16).save_pretrained(stored)
    assert next(open_model(stored).model.parameters()).dtype == torch.bfloat16
    assert next(open_model(stored, dtype="float32").model.parameters()).dtype == torch.float32


# ---- attnlab.load ---------------------------------------------------------------------------------


def test_load_gives_a_language_model_with_the_usual_helpers(llama) -> None:  # noqa: ANN001
    folder, reference = llama
    lm = attnlab.load(folder, dtype="float64")
    ids = lm.tokenize(TEXTS[0])
    assert ids[0] == lm.task.bos_id and lm.decode(ids) == TEXTS[0]
    assert "".join(lm.to_str_tokens(TEXTS[0])[1:]) == TEXTS[0]
    assert lm.to_single_token(lm.to_str_tokens(TEXTS[0])[1]) == ids[1]
    with pytest.raises(UsageError, match="not one"):
        lm.to_single_token(TEXTS[0])
    logits, loss = lm(TEXTS[:2], return_type="both")
    tokens = torch.tensor([ids])
    with torch.no_grad():
        expected = reference(tokens, labels=tokens).loss
    got = lm(TEXTS[0], return_type="loss")  # transformers' own loss (which it takes in float32)
    torch.testing.assert_close(got, expected, check_dtype=False, rtol=1e-6, atol=0)
    assert logits.shape[:2] == (2, max(len(lm.tokenize(t)) for t in TEXTS[:2])) and loss.dim() == 0
    assert lm.head_mask_shapes == {"self": (2, 4)}
    with lm.trace("decoder.1.attn.pattern") as traced:
        lm(TEXTS[0])
    assert traced.cache["decoder.1.attn.pattern"].shape == (1, 4, len(ids), len(ids))


def test_load_generates_greedily_by_sampling_and_as_a_stream(llama) -> None:  # noqa: ANN001
    folder, _ = llama
    lm = attnlab.load(folder)
    greedy = lm.generate(TEXTS[1], max_new_tokens=6)
    assert "".join(lm.generate(TEXTS[1], max_new_tokens=6, stream=True)) == greedy
    first = lm.generate(TEXTS[1], max_new_tokens=6, temperature=1.0, seed=7)
    assert lm.generate(TEXTS[1], max_new_tokens=6, temperature=1.0, seed=7) == first
    with pytest.raises(UsageError, match="only when sampling"):
        lm.generate(TEXTS[1], top_k=3)


@pytest.mark.parametrize(
    ("damage", "code", "words"),
    [
        ("no_config", 2, "no config.json"),
        ("truncated", 3, "model.safetensors: not a complete safetensors file"),
        (
            "model_type",
            2,
            "model_type 'no_such_type' is no causal language model or encoder-decoder transformers knows",
        ),
        ("absent_name", 2, "no model of that name in the Hugging Face cache"),
    ],
)
def test_the_cli_gives_one_error_line_and_its_exit_code(
    llama, tmp_path, monkeypatch, capsys, damage, code, words
) -> None:  # noqa: ANN001, PLR0913
    from attnlab.cli import main

    folder, _ = llama
    source = _copy(folder, tmp_path / "model")
    if damage == "no_config":
        (source / "config.json").unlink()
    elif damage == "truncated":
        data = (source / "model.safetensors").read_bytes()
        (source / "model.safetensors").write_bytes(data[:20])
    elif damage == "model_type":
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "model_type": "no_such_type"}))
    else:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
        source = "org/absent"
    out = tmp_path / "maps"
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", str(source), TEXTS[0], "--out", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert not out.exists()  # nothing half-written


def test_import_hf_writes_a_run_that_computes_the_checkpoint(llama, tmp_path, capsys) -> None:  # noqa: ANN001
    from attnlab.cli import main
    from attnlab.run.verification import verify_run

    folder, _ = llama
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "hf", str(folder), "--out", str(out), "--json"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["kind"] == "decoder_only"
    assert not verify_run(out).problems
    torch.testing.assert_close(_logits(out), _logits(folder))


def test_tensors_used_as_stored_are_views_of_the_file_and_writes_stay_private(llama, tmp_path) -> None:  # noqa: ANN001
    """Opening copies nothing it need not: the embedding and the gate and up projections (adjacent
    in the file, stacked as one tensor) are views of the shard's one mapping; Q, K and V (apart in
    the file) are read into their rows. A write to a weight changes neither the file nor a model
    opened after it."""
    import hashlib

    folder = _copy(llama[0], tmp_path / "llama")
    weights = folder / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()
    loaded = open_model(folder)
    layer = loaded.model.decoder.layers[0]
    mapping = loaded.model.decoder.embedding.token.weight.untyped_storage().data_ptr()
    assert layer.feed_forward.linear1.weight.untyped_storage().data_ptr() == mapping
    assert layer.self_attn.in_proj_weight.untyped_storage().data_ptr() != mapping
    before = _logits(folder)
    with torch.no_grad():
        layer.feed_forward.linear1.weight.add_(1.0)
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest
    torch.testing.assert_close(_logits(folder), before)


def test_a_tensor_not_aligned_for_its_dtype_is_read_not_viewed(llama) -> None:  # noqa: ANN001
    from dataclasses import replace

    from attnlab.pretrained.checkpoint import read_tensors

    name, stored = next(iter(read_tensors(find_checkpoint(llama[0]))))
    assert stored.view() is not None
    shifted = replace(stored, begin=stored.begin + 1, end=stored.end + 1)
    assert shifted.view() is None
    torch.testing.assert_close(stored.read(), stored.view())


def _damage_folder(source: Path, damage: str) -> None:
    """One fault a user's folder can have (see the test below)."""
    weights = source / "model.safetensors"
    index = source / "model.safetensors.index.json"
    if damage == "tokenizer_not_json":
        (source / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    elif damage == "tokenizer_missing":
        (source / "tokenizer.json").unlink()
    elif damage == "tokenizer_config_not_json":
        (source / "tokenizer_config.json").write_text("{chat_template")
    elif damage == "config_not_json":
        (source / "config.json").write_bytes(b"\xff\xfe not json")
    elif damage == "config_shapes":
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] * 2}))
    elif damage == "config_vocab":
        config = json.loads((source / "config.json").read_text())
        (source / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 3}))
    elif damage == "weights_empty":
        weights.write_bytes(b"")
    elif damage == "weights_header_garbage":
        weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"{not json at all" + weights.read_bytes()[24:])
    elif damage == "weights_nan":
        data = bytearray(weights.read_bytes())
        data[-4:] = b"\x00\x00\xc0\x7f"  # float32 NaN in the last tensor
        weights.write_bytes(bytes(data))
    elif damage == "index_not_json":
        index.write_text("[")
    elif damage == "index_names_missing_shard":
        index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}))
    elif damage == "index_outside":
        index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "../model.safetensors"}}))
    elif damage == "index_incomplete":
        index.write_text(json.dumps({"weight_map": {"model.embed_tokens.weight": "model.safetensors"}}))
    elif damage in ("rope_theta", "rms_norm_eps", "max_position_embeddings"):
        config = json.loads((source / "config.json").read_text())
        value = {"rope_theta": 1e30, "rms_norm_eps": 3e33, "max_position_embeddings": 1 << 40}[damage]
        if damage == "rope_theta":
            config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_theta": value}
        (source / "config.json").write_text(
            json.dumps({**config, **({} if damage == "rope_theta" else {damage: value})})
        )
    elif damage == "chat_template_broken":
        settings = json.loads((source / "tokenizer_config.json").read_text())
        (source / "tokenizer_config.json").write_text(json.dumps({**settings, "chat_template": "{% if x %}"}))


@pytest.mark.parametrize(
    ("damage", "code", "words"),
    [
        ("tokenizer_not_json", 3, "tokenizer.json:1: not valid JSON"),  # damaged: 3, as config.json
        ("tokenizer_missing", 2, "no tokenizer (tokenizer.json, tokenizer.model, or vocab.json + merges.txt)"),
        ("tokenizer_config_not_json", 3, "tokenizer_config.json: not readable JSON"),
        ("config_not_json", 3, "config.json: not readable JSON"),
        ("config_shapes", 3, "do not fit"),
        ("config_vocab", 3, "lm_head.weight (320, 32) do not fit lm_head.weight of shape (323, 32) from config.json"),
        ("weights_empty", 3, "model.safetensors: not a complete safetensors file"),
        ("weights_header_garbage", 3, "model.safetensors: not a complete safetensors file"),
        ("weights_nan", 3, "holds NaN or infinite values"),
        ("index_not_json", 3, "model.safetensors.index.json: not readable JSON"),
        ("index_names_missing_shard", 3, "shard model-00002-of-00002.safetensors is missing"),
        ("index_outside", 3, "shard '../model.safetensors' is not a file name"),
        ("index_incomplete", 3, "is not where model.safetensors.index.json puts it"),
        ("chat_template_broken", 3, "chat_template is not a valid Jinja template"),
        ("rope_theta", 3, "config.json is damaged: model.rope_base 1e+30 is not in [1, 1e+09]"),
        ("rms_norm_eps", 3, "config.json is damaged: model.layer_norm_eps 3e+33 is not in [1e-12, 0.01]"),
        ("max_position_embeddings", 3, "max_position_embeddings = 1,099,511,627,776 is not in [0, 16,777,216]"),
    ],
)
def test_every_fault_of_a_folder_is_one_error_line_and_nothing_written(
    llama, tmp_path, capsys, damage, code, words
) -> None:  # noqa: ANN001, PLR0913
    """The probe of issue 37 on Hugging Face folders, through ``attnlab import hf`` (which writes)."""
    from attnlab.cli import main

    folder, _ = llama
    source = _copy(folder, tmp_path / "model")
    if not (source / "tokenizer_config.json").exists():
        (source / "tokenizer_config.json").write_text("{}")
    _damage_folder(source, damage)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["import", "hf", str(source), "--out", str(out)])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert exit_info.value.code == code, err
    assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], err
    assert not out.exists()  # nothing half-written


def test_weights_values_are_checked_once_per_version_of_the_file(llama, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The pass over every weight runs at the first open of a file and again only once it changes."""
    import os

    from attnlab.pretrained import layout

    folder = _copy(llama[0], tmp_path / "llama")
    checked = []
    real = layout.check_weights
    monkeypatch.setattr(layout, "check_weights", lambda *a, **k: checked.append(a[0]) or real(*a, **k))
    open_model(folder)
    first = len(checked)
    open_model(folder)
    assert first > 0 and len(checked) == first
    os.utime(folder / "model.safetensors", ns=(1, 1))  # another version of the file, as far as anyone can tell
    open_model(folder)
    assert len(checked) == 2 * first


def test_a_source_that_is_no_file_nor_folder_says_what_it_is(tmp_path) -> None:  # noqa: ANN001
    import os

    fifo, zero, loop = tmp_path / "model.gguf", tmp_path / "zero.gguf", tmp_path / "loop"
    os.mkfifo(fifo)
    zero.symlink_to("/dev/zero")
    loop.symlink_to(loop)
    cases = {fifo: r"a FIFO \(named pipe\), not a regular file", zero: "a character device", loop: "a symlink loop"}
    for path, words in cases.items():
        with pytest.raises(UsageError, match=words):
            open_model(path)
