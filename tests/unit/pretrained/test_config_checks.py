"""An imported Hugging Face config is checked against attnlab's caps before anything is built.

A tiny Llama folder (transformers' config class and ``save_pretrained``) is damaged one key at a
time: each case is one AttnlabError naming the key and the file, within seconds, opened natively
and through the bridge, and one ``error:`` line with exit code 3 from the command line. A legacy
``rope_scaling`` is read as transformers 5 reads it (logits equal), a tensor stored as F64 among
F32 ones is converted as transformers converts it, and an int8 weight is named.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import attnlab
from attnlab.errors import AttnlabError, CheckpointError, ConfigError
from attnlab.limits import MAX_HEADS
from attnlab.nn import DecoderOnlyConfig
from attnlab.nn.multi_head import MultiHeadAttention
from attnlab.pretrained.checkpoint import find_checkpoint
from attnlab.pretrained.hf_model import open_checkpoint
from tests.cli import attnlab as run_cli
from tests.unit.pretrained.tiny_hf import build

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SECONDS = 10.0
"""A refusal comes before anything is built: well within this, where building would hang."""


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder, left as saved (each test copies it)."""
    folder = tmp_path_factory.mktemp("llama")
    build("llama", folder)
    return folder


def _copy(llama: Path, tmp_path: Path, change: Callable[[dict[str, Any]], None] | None = None) -> Path:
    folder = tmp_path / "model"
    shutil.copytree(llama, folder)
    if change is not None:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        change(config)
        (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


def _set(**values: Any) -> Callable[[dict[str, Any]], None]:
    return lambda config: config.update(values)


HOSTILE = {
    "layers 1e12": (_set(num_hidden_layers=1e12), "num_hidden_layers"),
    "layers 10**12": (_set(num_hidden_layers=10**12), "num_hidden_layers"),
    "heads 10**12": (_set(num_attention_heads=10**12), "num_attention_heads"),
    "kv heads -1": (_set(num_key_value_heads=-1), "num_key_value_heads"),
    "width 10**9": (_set(intermediate_size=10**9), "intermediate_size"),
    "head_dim 1e12": (_set(head_dim=1e12), "head_dim"),
    "vocab 10**12": (_set(vocab_size=10**12), "vocab_size"),
    "positions 10**12": (_set(max_position_embeddings=10**12), "max_position_embeddings"),
    "bos 10**9": (_set(bos_token_id=10**9), "bos_token_id"),
    "bos -5": (_set(bos_token_id=-5), "bos_token_id"),
    "eos list": (_set(eos_token_id=[1, 10**9]), "eos_token_id"),
    "pad text": (_set(pad_token_id="<pad>"), "pad_token_id"),
    "dtype int8": (_set(dtype="int8"), "dtype"),
    "torch_dtype int8": (_set(torch_dtype="int8"), "torch_dtype"),
    "rope_scaling unknown key": (_set(rope_scaling={"type": "linear", "factor": 4.0, "bogus": 1}), "bogus"),
    "rope_scaling list value": (_set(rope_scaling={"type": "linear", "factor": [4.0]}), "rope_scaling.factor"),
    "rope_scaling negative": (_set(rope_scaling={"type": "linear", "factor": -4.0}), "rope_scaling.factor"),
    "rope_scaling a list": (_set(rope_scaling=[1, 2]), "rope_scaling"),
    "rope_scaling unknown type": (_set(rope_scaling={"type": "warp", "factor": 2.0}), "rope_scaling.rope_type"),
    "rope factor 0": (
        _set(rope_parameters={"rope_type": "linear", "factor": 0, "rope_theta": 10000.0}),
        "rope_parameters.factor",
    ),
    "rope factor -2": (
        _set(rope_parameters={"rope_type": "linear", "factor": -2, "rope_theta": 10000.0}),
        "rope_parameters.factor",
    ),
    "rope factor list": (
        _set(rope_parameters={"rope_type": "linear", "factor": [1, 2], "rope_theta": 10000.0}),
        "rope_parameters.factor",
    ),
    "rope theta inf": (_set(rope_parameters={"rope_type": "default", "rope_theta": float("inf")}), "rope_theta"),
    "rope_parameters a list": (_set(rope_parameters=[1, 2]), "rope_parameters"),
    "legacy drops a base": (
        _set(
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            rope_scaling={"type": "linear", "factor": 4.0},
        ),
        "disagree on rope_theta",
    ),
}
"""case -> (the change to config.json, what the message names)."""


@pytest.mark.parametrize("bridge", [False, True], ids=["native", "bridged"])
@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_config_is_one_error_naming_the_key_and_the_file(
    case: str, bridge: bool, llama: Path, tmp_path: Path
) -> None:
    change, named = HOSTILE[case]
    folder = _copy(llama, tmp_path, change)
    started = time.monotonic()
    with pytest.raises((CheckpointError, ConfigError)) as raised:
        attnlab.load(folder, bridge=bridge)
    assert time.monotonic() - started < SECONDS
    message = str(raised.value)
    assert named in message and str(folder / "config.json") in message, message


def test_a_special_id_of_generation_config_is_checked_too(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 10**9}), encoding="utf-8")
    with pytest.raises(CheckpointError, match="generation_config.json: eos_token_id = 1,000,000,000 is not in"):
        attnlab.load(folder)


def test_a_pad_id_of_minus_one_means_none_as_transformers_reads_it(llama: Path, tmp_path: Path) -> None:
    lm = attnlab.load(_copy(llama, tmp_path, _set(pad_token_id=-1)))  # Llama 1's configs write it
    assert lm.task.pad_id >= 0 and isinstance(lm.generate("hello", max_new_tokens=2), str)


@pytest.mark.parametrize("case", ["layers 1e12", "rope factor 0", "bos -5"])
def test_the_cli_says_one_error_line_and_exits_3(case: str, llama: Path, tmp_path: Path) -> None:
    change, named = HOSTILE[case]
    folder = _copy(llama, tmp_path, change)
    done = run_cli("generate", str(folder), "hello", timeout=120, one_thread=True)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, done.stderr
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], done.stderr


@pytest.mark.parametrize("bridge", [False, True], ids=["native", "bridged"])
def test_a_tokenizer_past_the_model_vocabulary_is_refused_at_open(bridge: bool, llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path, _set(vocab_size=100))
    with pytest.raises(ConfigError, match=r"tokenizer\.json: .* at or past the model's 100 embedding rows .* = 100"):
        attnlab.load(folder, bridge=bridge)


def test_a_config_without_model_type_says_so(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path, lambda config: config.pop("model_type"))
    with pytest.raises(CheckpointError, match="config.json has no model_type"):
        attnlab.load(folder)


def test_a_config_json_past_the_cap_is_refused_by_name(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path, _set(padding="x" * (65 * 2**20)))
    with pytest.raises(CheckpointError, match=r"config\.json: more than 67,108,864 bytes"):
        attnlab.load(folder)


# ---- meanings transformers gives -------------------------------------------------------------------------


def _logits_equal_transformers(folder: Path, *, dtype: torch.dtype, atol: float) -> None:
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
    ours = open_checkpoint(find_checkpoint(folder), dtype=None if dtype == torch.float32 else dtype).model
    assert {p.dtype for p in ours.parameters()} == {dtype}
    tokens = torch.tensor([[0, 5, 9, 14, 3, 60, 7, 8, 11, 12, 40, 41]])
    with torch.no_grad():
        expected = reference(input_ids=tokens).logits
        got = ours(tokens, is_token=torch.ones_like(tokens, dtype=torch.bool))
    assert torch.allclose(got, expected, atol=atol, rtol=0), (got - expected).abs().max()


def test_a_legacy_rope_scaling_beside_default_rope_parameters_is_read_as_transformers_reads_it(
    llama: Path, tmp_path: Path
) -> None:
    def legacy(config: dict[str, Any]) -> None:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        config["rope_scaling"] = {"type": "linear", "factor": 4.0}

    folder = _copy(llama, tmp_path, legacy)
    _logits_equal_transformers(folder, dtype=torch.float64, atol=1e-6)
    plain = open_checkpoint(find_checkpoint(_copy(llama, tmp_path / "plain")), dtype=torch.float64).model
    assert plain.config.rope_scaling is None  # the scaling changes the function: the test sees it
    assert open_checkpoint(find_checkpoint(folder)).model.config.rope_scaling["factor"] == 4.0


def _resave(folder: Path, change: Callable[[str, torch.Tensor], torch.Tensor]) -> None:
    path = folder / "model.safetensors"
    tensors = {name: change(name, tensor) for name, tensor in safetensors_torch.load_file(path).items()}
    safetensors_torch.save_file(tensors, path, metadata={"format": "pt"})


def test_a_tensor_stored_as_f64_among_f32_is_converted_as_transformers_converts_it(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path)
    odd = "model.layers.0.mlp.up_proj.weight"
    _resave(folder, lambda name, tensor: tensor.double() if name == odd else tensor)
    _logits_equal_transformers(folder, dtype=torch.float32, atol=1e-5)
    _logits_equal_transformers(folder, dtype=torch.float64, atol=1e-6)


def test_an_int8_weight_is_named_with_its_dtype(llama: Path, tmp_path: Path) -> None:
    folder = _copy(llama, tmp_path)
    odd = "model.layers.0.self_attn.q_proj.weight"
    _resave(folder, lambda name, tensor: torch.ones_like(tensor, dtype=torch.int8) if name == odd else tensor)
    with pytest.raises(CheckpointError, match=rf"'{odd}' is stored as I8; attnlab reads float weights") as raised:
        attnlab.load(folder)
    assert "model.safetensors" in str(raised.value)


# ---- attnlab.nn's own constructors ------------------------------------------------------------------------


def test_the_model_constructors_refuse_too_many_heads_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"heads: 1,000,000,000,000 heads, more than the cap of {MAX_HEADS:,}"):
        MultiHeadAttention(d_model=16, heads=10**12, d_k=2)
    with pytest.raises(ConfigError, match="kv_heads: .* more than the cap"):
        MultiHeadAttention(d_model=16, heads=4, kv_heads=10**12)
    with pytest.raises(ConfigError, match="heads: .* more than the cap"):
        DecoderOnlyConfig(vocab_size=10, layers=1, d_model=16, heads=10**12, d_k=2, d_ff=8)
    assert time.monotonic() - started < SECONDS
    assert isinstance(ConfigError("x"), AttnlabError)
