"""`attnlab attribute` and `attnlab heads detect` through the command line: their files, their
console summary, and bad input as one error line."""

from __future__ import annotations

import csv
import json

import pytest

from tests.cli import attnlab
from tests.unit.analysis.tiny_lm import tiny_lm_run
from tests.unit.analysis.tiny_runs import tiny_run


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return tiny_lm_run(tmp_path_factory.mktemp("cli-attribute"))


@pytest.fixture(scope="module")
def seq2seq(tmp_path_factory):
    return tiny_run(tmp_path_factory.mktemp("cli-attribute-seq2seq"), "encoder_decoder")


def _rows(path):
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.DictReader(handle))


def test_attribute_writes_tables_and_pictures_whose_terms_sum_to_the_logit(lm, tmp_path):
    run, _ = lm
    out = tmp_path / "attribute"
    result = attnlab("attribute", str(run), "the cat sat", "--answer", "a", "--wrong", "o", "--out", str(out), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["measure"] == "logit['a'] - logit['o']"
    assert sum(term["contribution"] for term in report["terms"]) == pytest.approx(report["value"], abs=1e-4)
    terms = _rows(out / "terms.csv")
    assert [t["term"] for t in terms][:2] == ["embed", "0.attn.head.0"] and terms[-1]["term"] == "unembed.bias"
    assert len(_rows(out / "heads.csv")) == 2 * 6 and list(_rows(out / "layers.csv")[0]) == [
        "layer",
        "attention",
        "ffn",
    ]
    lens = _rows(out / "logit_lens.csv")
    assert [row["site"] for row in lens] == ["resid_pre", "resid_pre", "resid_post"]
    assert int(lens[-1]["answer_rank"]) >= 1
    for name in ("heads.png", "layers.png", "logit_lens.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    text = attnlab("attribute", str(run), "the cat sat", "--answer", "a", "--out", str(out))
    assert text.returncode == 0, text.stderr
    assert "heads contributing most: self:" in text.stdout and "logit lens: 'a'" in text.stdout


def test_heads_detect_writes_the_scores_and_names_the_top_heads(lm, tmp_path):
    run, texts = lm
    out = tmp_path / "detect"
    result = attnlab("heads", "detect", str(run), "--texts", str(texts), "--length", "10", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert "induction (8 sequences of 10 random tokens repeated twice): self:" in result.stdout
    assert f"previous_token (the texts of {texts}): self:" in result.stdout
    rows = _rows(out / "detect.csv")
    assert list(rows[0]) == [
        "kind", "layer", "head", "previous_token", "duplicate_token", "induction", "bos", "positional",
        "positional_offset",
    ]  # fmt: skip
    assert len(rows) == 2 * 6
    for name in ("previous_token", "duplicate_token", "induction", "bos", "positional"):
        assert (out / f"detect_{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_heads_detect_on_an_encoder_decoder_leaves_out_cross_attention(seq2seq, tmp_path):
    result = attnlab("heads", "detect", str(seq2seq), "--out", str(tmp_path / "detect"), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {head["kind"] for head in report["heads"]} == {"encoder_self", "decoder_self"}
    assert any("cross-attention" in note for note in report["notes"])
    assert any(
        note.startswith("induction: not scored for bidirectional attention (encoder_self") for note in report["notes"]
    )
    assert all((head["induction"] is None) == (head["kind"] == "encoder_self") for head in report["heads"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["attribute", "RUN", "the cat", "--answer", "ab"], "--answer: 'ab' is 2 tokens"),
        (["attribute", "RUN", "the cat", "--answer", "a", "--wrong", "a"], "--wrong: 'a' is the answer's token"),
        (["attribute", "RUN", "", "--answer", "a"], "TEXT: empty input"),
        (["heads", "detect", "RUN", "--length", "100"], "--length 100 (repeated twice): 200 tokens"),
        (["heads", "detect", "RUN", "--texts", "EMPTY"], "empty file"),
    ],
)
def test_bad_input_is_one_error_line(lm, tmp_path, capsys, args, message):
    """In this process (the commands' errors come before any file is written)."""
    from attnlab.cli import main

    run, _ = lm
    empty = tmp_path / "empty.txt"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(SystemExit) as exit_info:
        main([str(run) if a == "RUN" else str(empty) if a == "EMPTY" else a for a in args])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert error.strip().splitlines()[-1].startswith("error: ") and message in error


def test_attribute_needs_a_language_model(seq2seq):
    result = attnlab("attribute", str(seq2seq), "abc", "--answer", "a")
    assert result.returncode == 2 and "error: RUN: the logits read here are a language model's" in result.stderr
