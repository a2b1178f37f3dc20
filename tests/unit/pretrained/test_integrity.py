"""Damaged GGUF files (a tiny one written here) are refused in our words, naming the file and the
field or tensor, with exit code 3 and nothing written; what is possible but unusual is a warning."""

from __future__ import annotations

import struct
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.cli import main
from attnlab.errors import AttnlabWarning, CheckpointError
from attnlab.pretrained.gguf import read_gguf
from attnlab.pretrained.integrity import check_chat_template, check_weights
from tests.unit.pretrained.tiny_gguf import data_offset, tensor_entry, write_tiny_gguf

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def _import(capsys, monkeypatch, source: Path, out: Path) -> tuple[int, str]:
    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)  # main() replaces it
    with pytest.raises(SystemExit) as exited:
        main(["import", "gguf", str(source), "--out", str(out)])
    return exited.value.code or 0, capsys.readouterr().err


def _patched(clean: Path, folder: Path, at: int, data: bytes) -> Path:
    damaged = bytearray(clean.read_bytes())
    damaged[at : at + len(data)] = data
    path = folder / "damaged.gguf"
    path.write_bytes(bytes(damaged))
    return path


def test_the_tiny_file_imports_clean(clean, tmp_path, capsys, monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        code, err = _import(capsys, monkeypatch, clean, tmp_path / "run")
    assert code == 0, err


def _type_flipped(clean: Path, folder: Path) -> Path:  # Q4_1 (3) read as Q4_0 (2): weights off by 1.58 in the probe
    return _patched(clean, folder, tensor_entry(clean, "blk.0.ffn_down.weight")[0], struct.pack("<I", 2))


def _offset_moved(clean: Path, folder: Path) -> Path:  # a norm weight read from inside another tensor
    at = tensor_entry(clean, "blk.0.attn_norm.weight")[1]
    offset = struct.unpack_from("<Q", clean.read_bytes(), at)[0]
    return _patched(clean, folder, at, struct.pack("<Q", offset + 64))


def _cut(clean: Path, folder: Path) -> Path:
    path = folder / "cut.gguf"
    path.write_bytes(clean.read_bytes()[:-100])
    return path


def _string_length(clean: Path, folder: Path) -> Path:  # a key's length field turned huge
    at = clean.read_bytes().index(b"general.architecture") - 8
    return _patched(clean, folder, at, struct.pack("<Q", 1 << 40))


def _huge_norm_weight(clean: Path, folder: Path) -> Path:  # a data block's exponent bits flipped
    return _patched(clean, folder, data_offset(clean, "output_norm.weight") + 4, struct.pack("<f", 3.05e37))


def _nan_weight(clean: Path, folder: Path) -> Path:
    return _patched(clean, folder, data_offset(clean, "blk.0.attn_q.weight"), struct.pack("<f", float("nan")))


@pytest.mark.parametrize(
    ("damage", "says"),
    [
        (_type_flipped, "the last tensor 'blk.0.ffn_down.weight' (Q4_0, shape [64, 32]"),
        (_offset_moved, "tensor 'blk.0.attn_norm.weight' (F32"),
        (_cut, "runs past the end of the file"),
        (_string_length, "metadata key #0 (1099511627776 bytes at offset"),
        (_huge_norm_weight, "tensor 'output_norm.weight' holds a value of 3.05e+37"),
        (_nan_weight, "tensor 'blk.0.attn_q.weight' holds NaN or infinite values"),
        (
            lambda clean, folder: write_tiny_gguf(folder / "x.gguf", rope_base=1e30),
            "llama.rope.freq_base 1e+30 is not in [1, 1e+09]",
        ),
        (lambda clean, folder: write_tiny_gguf(folder / "x.gguf", rms_eps=0.0), "llama.attention.layer_norm_rms_eps"),
        (lambda clean, folder: write_tiny_gguf(folder / "x.gguf", context=1 << 30), "llama.context_length 1073741824"),
        (lambda clean, folder: write_tiny_gguf(folder / "x.gguf", eos=4000), "tokenizer.ggml.eos_token_id 4000"),
        (
            lambda clean, folder: write_tiny_gguf(folder / "x.gguf", template="{% for m in messages %}{{ m }"),
            "tokenizer.chat_template is not a valid Jinja template (line 1",
        ),
    ],
    ids=[
        "type-byte",
        "offset",
        "cut",
        "string-length",
        "norm-3e37",
        "nan",
        "rope",
        "eps",
        "context",
        "eos",
        "template",
    ],
)
def test_a_damaged_gguf_is_one_error_naming_the_file_and_field(clean, tmp_path, capsys, monkeypatch, damage, says):
    path = damage(clean, tmp_path)
    code, err = _import(capsys, monkeypatch, path, tmp_path / "run")
    assert code == 3, err
    assert err.count("\n") == 1 and err.startswith(f"error: {path} is damaged: ") and says in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"rope_base": float(np.float32(100000.0078))}, "llama.rope.freq_base 100000.0078125 is not a round number"),
        (
            {"rms_eps": 1.0000001e-5},
            f"llama.attention.layer_norm_rms_epsilon {float(np.float32(1.0000001e-5))!r} is not",
        ),
        ({"context": 8193}, "llama.context_length 8193 is odd"),
        ({"eos": 258}, "tokenizer.ggml.eos_token_id 258 names 'Ġt', not a control token"),
        ({"eos": 256}, "tokenizer.ggml.eos_token_id 256 names '<|im_start|>', which the chat template never writes"),
    ],
    ids=["rope-low-bit", "eps-low-bit", "context-odd", "eos-moved", "eos-moved-to-control"],
)
def test_possible_but_unusual_values_are_a_warning(tmp_path, changes, says):
    path = write_tiny_gguf(tmp_path / "x.gguf", **changes)
    with pytest.warns(AttnlabWarning) as caught:
        read_gguf(path)
    messages = [str(w.message) for w in caught if issubclass(w.category, AttnlabWarning)]
    assert any(message == f"{path}: {says}" or message.startswith(f"{path}: {says}") for message in messages), messages


def test_weights_are_finite_and_within_the_stated_ranges():
    where = Path("model.safetensors")
    check_weights("model.norm.weight", torch.full((4,), 999.0, dtype=torch.bfloat16), path=where)
    check_weights("model.embed_tokens.weight", torch.full((4,), 9e3), path=where)
    check_weights("ids", torch.tensor([1 << 40]), path=where)  # not a float: no range
    for name, value, says in [
        ("model.norm.weight", 2e3, "beyond the 1000 any model's norm weights reach"),
        ("model.layers.0.mlp.up_proj.weight", 2.1e4, "beyond the 10000 any model's weights reach"),
        ("lm_head.weight", float("inf"), "holds NaN or infinite values"),
    ]:
        with pytest.raises(CheckpointError, match=f"^model.safetensors is damaged: tensor '{name}' .*{says}"):
            check_weights(
                name, torch.tensor([0.0, -value], dtype=torch.float16 if value < 6e4 else torch.float32), path=where
            )


def test_a_chat_template_with_loop_controls_parses():
    check_chat_template(
        "{% for m in messages %}{% if loop.first %}{% break %}{% endif %}{% endfor %}", path=Path("x"), field="f"
    )


def test_the_families_round_values_are_round_and_one_flipped_low_bit_is_not():
    from attnlab.pretrained.integrity import _is_round

    for value in (1e-5, 1e-6, 1e-12, float(np.float32(1e-5)), 1e4, 75000.0, 5e5, 1e6, 5e7, 1.5e-6):
        assert _is_round(value), value
    for value in (float(np.float32(100000.0078)), float(np.float32(1.0000001e-5)), 10001.0):
        assert not _is_round(value), value
