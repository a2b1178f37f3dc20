"""attention_view and ``attnlab attention`` on a pretrained language model (the tiny random
Llama-style ``pretrained_lm`` run of :mod:`tests.unit.analysis.tiny_lm`): the model's own prompt (no
BOS, as SmolLM2 has none), every position a real token although the pad id is a frequent one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.analysis.maps import attention_view, kind_maps
from attnlab.cli import main
from attnlab.errors import UsageError
from attnlab.generate.search import DecodeOptions, generate_continuations
from attnlab.nn import trace
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import PAD, tiny_lm_run

TEXT = "the cat sat"  # holds "e", the pad (and eos) id: padding read from the id would hide it


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    return tiny_lm_run(tmp_path_factory.mktemp("maps-lm"))[0]


@pytest.fixture(scope="module")
def loaded(run):
    return open_run(run)


def test_the_prompt_is_the_texts_own_tokens_without_a_bos(loaded):
    view = attention_view(loaded, TEXT, max_length=3)
    ids = loaded.task.tokenizer.encode(TEXT)
    assert PAD in ids and loaded.task.bos_id == -1
    queries, keys = view.axes["self"]
    assert queries == keys
    assert queries[: len(ids)] == loaded.codec.tokens(ids) == list(TEXT)  # byte-level "Ġ" shown as the space it is


def test_the_maps_cover_the_prompt_unless_the_continuation_is_asked_for(loaded):
    ids = loaded.task.tokenizer.encode(TEXT)
    prompt_only = attention_view(loaded, TEXT, max_length=3)
    both = attention_view(loaded, TEXT, max_length=3, continuation=True)
    assert prompt_only.output == both.output
    assert [t for t, _ in prompt_only.distribution] == [t for t, _ in both.distribution]
    assert [p for _, p in prompt_only.distribution] == pytest.approx([p for _, p in both.distribution], abs=1e-6)
    assert prompt_only.axes["self"][0] == loaded.codec.tokens(ids)
    assert np.stack(kind_maps(prompt_only, "self")).shape[2:] == (len(ids), len(ids))
    drawn = len(both.axes["self"][0])
    assert drawn > len(ids) and np.stack(kind_maps(both, "self")).shape[2:] == (drawn, drawn)


def test_next_token_distribution_and_maps_are_the_models_over_real_tokens(loaded):
    view = attention_view(loaded, TEXT, max_length=3, top_k=4, continuation=True)
    ids = loaded.task.tokenizer.encode(TEXT)
    continuation = generate_continuations(
        loaded.model, [ids], eos_id=loaded.task.eos_id, banned=(), options=DecodeOptions(max_length=3)
    )[0].tokens
    assert view.output == loaded.codec.decode(continuation)
    full = torch.tensor([ids + continuation])
    with torch.no_grad(), trace(loaded.model, "*.attn.pattern") as traced:
        logits = loaded.model(full, is_token=torch.ones_like(full, dtype=torch.bool))
    expected = torch.softmax(logits[0, len(ids) - 1], -1)
    values, indices = expected.topk(4)
    assert [token for token, _ in view.distribution] == loaded.codec.tokens(indices.tolist())
    assert [p for _, p in view.distribution] == pytest.approx(values.tolist(), abs=1e-6)
    maps = np.stack(kind_maps(view, "self"))
    assert maps.shape == (2, 6, full.shape[1], full.shape[1])  # 2 layers x 6 query heads (2 kv heads)
    np.testing.assert_allclose(maps, np.stack([t[0].numpy() for t in traced.cache.values()]), atol=1e-6)
    with torch.no_grad():  # reading padding from the id would have masked every "e": another distribution
        by_id = torch.softmax(loaded.model(full)[0, len(ids) - 1], -1)
    assert not torch.allclose(by_id, expected, atol=1e-4)


def test_a_prompt_longer_than_the_context_is_refused(loaded):
    with pytest.raises(UsageError, match="65 tokens, longer than the model's context of 64"):
        attention_view(loaded, "a" * 65)


def test_attention_command_draws_only_the_layers_asked_for(run, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", str(run), TEXT, "--out", str(tmp_path / "maps"), "--layers", "1", "--max-length", "2"])
    assert exit_info.value.code == 0, capsys.readouterr().err
    names = sorted(path.name for path in (tmp_path / "maps").iterdir())
    assert names == sorted([f"self_layer1_head{head}.png" for head in range(6)] + ["self_layer1_heads.png"])
    with pytest.raises(SystemExit) as exit_info:
        main(["attention", str(run), TEXT, "--out", str(tmp_path / "more"), "--layers", "0-2"])
    assert exit_info.value.code == 2
    assert "error: --layers: '0-2' is not within the model's layers 0-1" in capsys.readouterr().err
    assert not (tmp_path / "more").exists()
