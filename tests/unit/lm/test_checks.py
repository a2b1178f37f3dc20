"""The command line's caps and checks hold from Python too: ``attnlab.load`` and the methods of
``LanguageModel`` refuse what ``attnlab generate`` refuses, with one UsageError naming the argument,
before any work (a tiny byte-level model with a context of 64 positions)."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.errors import UsageError
from attnlab.lm import LanguageModel
from attnlab.run.loaded import open_run
from tests.unit.analysis.tiny_lm import tiny_lm_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    path, _ = tiny_lm_run(tmp_path_factory.mktemp("checks"))
    return path


@pytest.fixture(scope="module")
def lm(run) -> LanguageModel:
    return LanguageModel(open_run(run))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_new_tokens": 10**9}, r"max_new_tokens: must be an integer in \[1, 4,096\]"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 2.5}, "max_new_tokens"),
        ({"temperature": float("nan")}, "temperature: must be a number >= 0"),
        ({"temperature": -1.0}, "temperature: must be a number >= 0"),
        ({"temperature": 1e9}, r"temperature: must lie in \[0, "),
        ({"temperature": 1.0, "seed": -1}, r"seed: must be an integer in \[0, "),
        ({"temperature": 1.0, "top_p": 0.0}, r"top_p: must lie in \(0, 1\]"),
        ({"seed": 3}, "top_k, top_p, seed: only when sampling"),
    ],
)
def test_generation_options_outside_their_ranges_are_refused(lm, options, message) -> None:
    with pytest.raises(UsageError, match=message):
        lm.generate("hello", **options)


def test_inputs_beyond_the_models_context_or_the_text_cap_are_refused(lm) -> None:
    with pytest.raises(UsageError, match="text: 100 tokens, longer than the model's context of 64"):
        lm.generate("x" * 100)
    with pytest.raises(UsageError, match="inputs: 100 tokens, longer than the model's context of 64"):
        lm("x" * 100)
    with pytest.raises(UsageError, match="inputs: 100 tokens, longer than the model's context of 64"):
        lm(torch.ones(1, 100, dtype=torch.long))
    with pytest.raises(UsageError, match="text: .* characters"):
        lm.generate("hello " * 20_000)
    with pytest.raises(UsageError, match="text\\[1\\]: 100 tokens"):
        lm.generate(["hello", "x" * 100])
    assert len(lm.generate("x" * 60, max_new_tokens=50)) <= 4  # decoding stops where the context ends


def test_ids_must_be_integers_of_the_vocabulary(lm) -> None:
    with pytest.raises(UsageError, match=r"inputs: integer ids of shape \(B, T\) or \(T,\) are needed"):
        lm(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(UsageError, match="inputs: texts or integer token ids are needed, got list of float"):
        lm([[1.0, 2.0]])
    with pytest.raises(UsageError, match="inputs: token id 256 is out of range"):
        lm([[1, 256]])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": torch.int8}, "dtype: float32, bfloat16, float16 or float64"),
        ({"dtype": 123}, "dtype: float32, bfloat16, float16 or float64"),
        ({"dtype": "int8"}, "--dtype: unknown 'int8'"),
        ({"revision": 123}, "revision: a non-empty string or None"),
        ({"verify": "no"}, "verify: True or False"),
        ({"bridge": 1}, "bridge: True or False"),
        ({"prepend_bos": "yes"}, "prepend_bos: True, False or None"),
    ],
)
def test_load_refuses_arguments_of_the_wrong_type_or_value(run, options, message) -> None:
    with pytest.raises(UsageError, match=message):
        attnlab.load(run, **options)


def test_load_refuses_a_source_that_is_no_path(run) -> None:
    with pytest.raises(UsageError, match="source: a path, a model's name or package:NAME is needed"):
        attnlab.load(123)  # type: ignore[arg-type]


def test_analyses_refuse_inputs_of_the_wrong_type(lm) -> None:
    with pytest.raises(UsageError, match="texts: a file's path or a list of texts is needed .* got int"):
        lm.importance(123)
    with pytest.raises(UsageError, match="inputs: texts or integer token ids are needed, got float"):
        lm.importance([1.5, 2.5])


def test_the_padding_mask_is_is_token_and_hugging_faces_name_is_one_usage_error(lm) -> None:
    tokens, is_token = lm.to_tokens(["the cat sat", "a dog"], return_mask=True)
    assert not bool(is_token[1, 0])  # left padding
    torch.testing.assert_close(lm(tokens, is_token=is_token), lm(["the cat sat", "a dog"]), rtol=0, atol=0)
    refused = r"attention_mask: the \(B, T\) padding mask is named is_token here \(True = a real token\)"
    with pytest.raises(UsageError, match=refused):
        lm(tokens, attention_mask=is_token)
    with pytest.raises(UsageError, match=refused):
        lm.importance(tokens, attention_mask=is_token, progress=False)
    with pytest.raises(UsageError, match=refused):
        lm.run_with_cache(tokens, attention_mask=is_token)
    with pytest.raises(UsageError, match="is_token: only with ids"):
        lm.importance(["the cat sat"], is_token=is_token[:1], progress=False)


def test_a_site_the_model_lacks_is_one_usage_error(lm) -> None:
    with pytest.raises(UsageError, match="site 'decoder.9.nope': no such site in this model; did you mean"):
        with lm.trace("decoder.9.nope"):
            pass
    with pytest.raises(UsageError, match="site: a site name or glob .* is needed, got 123"):
        with lm.trace(123):  # type: ignore[arg-type]
            pass
