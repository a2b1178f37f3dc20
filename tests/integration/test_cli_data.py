"""``attnlab tokenize`` and ``attnlab word2vec`` through the real entry point."""

from __future__ import annotations

import json

import pytest

from attnlab.cli import main


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    out, err = capsys.readouterr()
    return exit_info.value.code or 0, out, err


def test_tokenize_rule_gives_the_seed_example(capsys):
    code, out, _ = run(capsys, "tokenize", "--kind", "rule", "Isn't this project amazing?")
    assert code == 0 and json.loads(out) == ["Is", "n't", "this", "project", "amazing", "?"]


def test_tokenize_trains_saves_and_loads(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat on the mat\nthe dog sat\n" * 10, encoding="utf-8")
    code, out, _ = run(capsys, "tokenize", "--kind", "bpe", "--train", str(corpus), "--vocab-size", "300", "the cat")
    assert code == 0 and "".join(json.loads(out)).replace("Ġ", " ") == "the cat"
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("[PAD]\n[UNK]\nthe\ncat\n", encoding="utf-8")
    code, out, _ = run(capsys, "tokenize", "--vocab", str(vocab), "the cat emu")
    assert code == 0 and json.loads(out) == ["the", "cat", "[UNK]"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--kind", "nope", "x"],
            "Invalid value for '--kind': 'nope': 'nope' is not one of 'word', 'rule', 'char', 'wordpiece', 'bpe'",
        ),
        (["x"], "--kind: required"),
        (["--kind", "word", "--train", "{empty}", "x"], "empty.txt: empty file"),
        (["--kind", "word", "--train", "{binary}", "x"], "binary.txt:2: bytes that are not UTF-8"),
        (["--kind", "char", "a\udcffb"], "lone surrogate U+DCFF"),
    ],
)
def test_tokenize_bad_input_exits_2(capsys, tmp_path, args, message):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.txt").write_bytes(b"fine\nnot \xff utf8\n")
    argv = [a.format(empty=tmp_path / "empty.txt", binary=tmp_path / "binary.txt") for a in args]
    code, out, err = run(capsys, "tokenize", *argv)
    assert code == 2 and out == ""
    assert err.startswith("error: ") and message in err


def test_word2vec_writes_vectors_and_a_summary(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the cat sat\nthe dog sat\nbad\xa0line\n", encoding="utf-8")
    out_file = tmp_path / "vectors.txt"
    code, out, _ = run(capsys, "word2vec", str(corpus), "--dim", "6", "--out", str(out_file), "--epochs", "1")
    assert code == 0 and "x 6 dims" in out and str(out_file) in out
    assert out_file.read_text(encoding="utf-8").splitlines()[0] == "6 6"


def test_word2vec_bad_lines_fail_or_are_skipped_and_counted(capsys, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the cat sat\n\xc3\x28 broken\nthe dog sat\n")
    out_file = tmp_path / "v.txt"
    code, _, err = run(capsys, "word2vec", str(corpus), "--dim", "4", "--out", str(out_file))
    assert code == 2 and "corpus.txt:2: bytes that are not UTF-8" in err and not out_file.exists()
    code, out, err = run(capsys, "word2vec", str(corpus), "--dim", "4", "--out", str(out_file), "--skip-bad-lines")
    assert code == 0 and "skipped 1 bad lines" in err and out_file.exists()
