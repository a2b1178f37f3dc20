"""Text tasks: TSV and plain-text readers, bad files named with their line, splits."""

from __future__ import annotations

import pytest

from attnlab.errors import ConfigError, DataError
from attnlab.tasks import get_task, read_lines, read_parallel
from attnlab.tokenizers import train_tokenizer


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "pairs.tsv: empty file"),
        (b"\n  \n", "pairs.tsv: empty file"),
        (b"a\tb\nc\xffd\te\n", "pairs.tsv:2: bytes that are not UTF-8"),
        (b"a\tb\nno tab here\n", "pairs.tsv:2: missing tab"),
        (b"a\tb\nc\td\te\n", "pairs.tsv:2: 2 tabs: expected exactly one"),
        (b"a\tb\n\tx\n", "pairs.tsv:2: empty source or target"),
        (b"a\tb\n" + b"x" * 50 + b"\ty\n", "pairs.tsv:2: line has 52 characters, more than max_line_chars=40"),
    ],
)
def test_bad_parallel_file_names_file_and_line(tmp_path, content, message):
    path = tmp_path / "pairs.tsv"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        read_parallel(path, max_line_chars=40)


def test_skip_bad_lines_is_opt_in_and_counted(tmp_path):
    path = tmp_path / "pairs.tsv"
    path.write_bytes(b"a\tb\nbad\nc\td\te\n\xff\tx\nf\tg\r\n")
    lines = read_parallel(path, skip_bad_lines=True)
    assert lines.items == (("a", "b"), ("f", "g"))
    assert lines.numbers == (1, 5)
    assert [bad.line for bad in lines.skipped] == [2, 3, 4]
    assert str(lines.skipped[0]).endswith("pairs.tsv:2: missing tab: expected 'source<TAB>target'")
    path.write_bytes(b"bad\n")
    with pytest.raises(DataError, match="no usable line \\(1 bad lines skipped\\)"):
        read_parallel(path, skip_bad_lines=True)


def test_plain_text_lines(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("one line\n\nanother line\n", encoding="utf-8")
    assert read_lines(path).items == ("one line", "another line")
    path.write_bytes(b"ok\n\xc3\x28\n")
    with pytest.raises(DataError, match="text.txt:2: bytes that are not UTF-8"):
        read_lines(path)


@pytest.fixture()
def parallel(tmp_path):
    rows = [f"w{i} " * (1 + i % 8) + f"\tz{i}" for i in range(200)]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n", encoding="utf-8")
    corpus = [r.replace("\t", " ") for r in rows]
    return tmp_path / "train.tsv", train_tokenizer("word", corpus, vocab_size=1000)


def test_translation_splits_are_disjoint_and_respect_length(parallel):
    path, tok = parallel
    task = get_task("translation", train_file=path, tokenizer=tok, max_train_length=4)
    splits = {name: task.split(name) for name in ("train", "valid", "test", "length_generalisation")}
    sources = {name: {e.source for e in ex} for name, ex in splits.items()}
    assert not sources["train"] & sources["test"] and not sources["train"] & sources["valid"]
    assert all(e.length <= 4 for name in ("train", "valid", "test") for e in splits[name])
    assert splits["length_generalisation"] and all(4 < e.length <= 8 for e in splits["length_generalisation"])
    e = splits["train"][0]
    assert e.source[-1] == tok.eos_id and tok.decode(e.source).split()[0].startswith("w")
    # Rows have 1..8 words; the 100 short ones are all kept, split three ways.
    assert sum(map(len, (splits["train"], splits["valid"], splits["test"]))) == 100


def test_lm_task(tmp_path):
    (tmp_path / "lm.txt").write_text("the cat sat\nthe dog ran\n" * 20, encoding="utf-8")
    tok = train_tokenizer("word", ["the cat sat", "the dog ran"], 50)
    task = get_task("lm", train_file=tmp_path / "lm.txt", tokenizer=tok)
    assert task.kind == "lm" and all(e.target and not e.source for e in task.train())
    with pytest.raises(ConfigError, match="task.tokenizer: expected Tokenizer, got 'word'"):
        get_task("lm", train_file=tmp_path / "lm.txt", tokenizer="word")
    with pytest.raises(ConfigError, match="translation"):
        get_task("translation")


def test_lm_task_generation_prompt_is_bos_then_the_text(tmp_path):
    from attnlab.errors import UsageError

    (tmp_path / "lm.txt").write_text("the cat sat\n" * 20, encoding="utf-8")
    tok = train_tokenizer("word", ["the cat sat"], 50)
    task = get_task("lm", train_file=tmp_path / "lm.txt", tokenizer=tok)
    assert task.generation_prompt("the cat") == [tok.bos_id, *tok.encode("the cat")]
    assert task.generation_banned == (tok.pad_id, tok.bos_id) and task.generation_context is None
    with pytest.raises(UsageError, match="--chat: this run's task \\(lm\\) has no chat template"):
        task.generation_prompt("the cat", chat=True)
