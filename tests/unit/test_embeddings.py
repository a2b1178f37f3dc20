"""word2vec training, vector files, and embedding initialisation (Agarwal §2.2)."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnlab.embeddings import Coverage, WordVectors, init_embedding, load_vectors, save_vectors, train_word2vec
from attnlab.errors import ConfigError, DataError

SENTENCES = [s.split() for s in ["the cat sat on the mat", "the dog sat on the log", "a cat and a dog"] * 20]


@pytest.fixture(scope="module")
def vectors() -> WordVectors:
    return train_word2vec(SENTENCES, 8, epochs=2, seed=1)


def test_word2vec_is_seeded_and_covers_the_corpus(vectors):
    assert set(vectors.index) == {w for s in SENTENCES for w in s}
    assert vectors.matrix.shape == (len(vectors), 8)
    assert torch.equal(train_word2vec(SENTENCES, 8, epochs=2, seed=1).matrix, vectors.matrix)


def test_file_round_trip_is_exact(vectors, tmp_path):
    save_vectors(vectors, tmp_path / "v.txt")
    back = load_vectors(tmp_path / "v.txt")
    assert dict(back.index) == dict(vectors.index)
    assert torch.equal(back.matrix, vectors.matrix)


_WORD = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(words=st.lists(_WORD, min_size=1, max_size=8, unique=True))
def test_every_word_without_a_space_or_line_break_survives_the_file(tmp_path, words):
    """Tokens such as a character tokenizer's " " cannot be stored: they are left out and
    reported, and everything written reads back (Unicode separators such as U+2028 included)."""
    vectors = WordVectors({w: i for i, w in enumerate(words)}, torch.randn(len(words), 3))
    left_out = save_vectors(vectors, tmp_path / "v.txt")
    assert left_out == [w for w in words if " " in w or "\n" in w or "\r" in w]
    kept = [w for w in words if w not in left_out]
    if not kept:
        return
    back = load_vectors(tmp_path / "v.txt")
    assert list(back.index) == kept
    assert torch.equal(back.matrix, vectors.matrix[[vectors.index[w] for w in kept]])


def test_glove_file_without_header(tmp_path):
    (tmp_path / "glove.txt").write_text("cat 1 2 3\ndog -1.5 0 2e-1\n", encoding="utf-8")
    glove = load_vectors(tmp_path / "glove.txt")
    assert glove.dim == 3 and torch.equal(glove["dog"], torch.tensor([-1.5, 0.0, 0.2]))


def test_init_embedding_copies_rows_and_reports_coverage(tmp_path):
    (tmp_path / "v.txt").write_text("2 3\ncat 1 2 3\ndog 4 5 6\n", encoding="utf-8")
    vectors = load_vectors(tmp_path / "v.txt")
    vocab = {"[PAD]": 0, "cat": 1, "dog": 2, "emu": 3, "[UNK]": 4}
    embedding = torch.nn.Embedding(5, 3, padding_idx=0)
    before = embedding.weight.detach().clone()
    coverage = init_embedding(embedding, vocab, vectors, skip={"[UNK]"})
    assert torch.equal(embedding.weight[1], torch.tensor([1.0, 2, 3]))
    assert torch.equal(embedding.weight[2], torch.tensor([4.0, 5, 6]))
    assert torch.equal(embedding.weight[3], before[3]) and torch.equal(embedding.weight[0], before[0])
    assert coverage == Coverage(found=2, total=3, missing=("emu",))
    assert coverage.ratio == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match="vectors have dim 3, the embedding has d_model=4"):
        init_embedding(torch.nn.Embedding(5, 4), vocab, vectors)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"", "v.txt: empty vectors file"),
        (b"cat 1 2\ndog 1\n", "v.txt:2: expected 2 values after the word, got 1"),
        (b"2 2\ncat 1 2\ndog 1 x\n", "v.txt:3: a value is not a number"),
        (b"3 2\ncat 1 2\ndog 1 2\n", "v.txt:1: header says 3 words, the file has 2"),
        (b"cat 1 2\ncat 3 4\n", "v.txt:2: word 'cat' repeated \\(first on line 1\\)"),
        (b"cat 1 2\n\xff 1 2\n", "v.txt:2: bytes that are not UTF-8"),
    ],
)
def test_bad_vector_files(tmp_path, content, message):
    (tmp_path / "v.txt").write_bytes(content)
    with pytest.raises(DataError, match=message):
        load_vectors(tmp_path / "v.txt")


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("epochs", 10**9, "epochs: must lie in [1, 10,000] (attnlab.limits.MAX_EPOCHS), got 1,000,000,000"),
        ("window", 10**9, "window: must lie in [1, 1,000] (attnlab.limits.MAX_WINDOW)"),
        ("min_count", 0, "min_count: must lie in [1, 1,000,000,000] (attnlab.limits.MAX_MIN_COUNT), got 0"),
    ],
)
def test_word2vec_counts_past_their_caps_are_refused_before_gensim_runs(option, value, message):
    """``epochs = 10**9`` once ran for ever."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        train_word2vec([["the", "cat"]], 8, **{option: value})
