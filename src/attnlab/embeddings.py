"""Word embeddings: train word2vec vectors and copy them into a model's token embedding.

After tokenization, each token becomes a vector x_i^(0) in R^{d_model}; stacked row-wise they form
the input matrix X^(0) (Agarwal §2.2, Remark 2.3). Word2Vec learns such vectors from a corpus with
a one-hidden-layer network; here the skip-gram variant (predict the context from the word) is
trained by gensim.

Files use the word2vec text format: an optional header line ``<count> <dim>``, then one line per
word, ``word v_1 ... v_dim``, separated by single spaces. GloVe files are the same without the
header, so :func:`load_vectors` reads both.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch
from torch import nn

from attnlab.errors import ConfigError, DataError
from attnlab.limits import MAX_EPOCHS, MAX_MIN_COUNT, MAX_WINDOW
from attnlab.reading import read_capped
from attnlab.resources import check_memory, check_vector_dim, word2vec_memory
from attnlab.run.storage import atomic_write

__all__ = ["WordVectors", "Coverage", "train_word2vec", "save_vectors", "load_vectors", "init_embedding"]


@dataclass(frozen=True)
class WordVectors:
    """Word vectors: ``matrix[index[word]]`` is the vector of ``word``.

    Shape:
        matrix: (n_words, dim), float32.
    """

    index: Mapping[str, int]
    matrix: torch.Tensor

    def __post_init__(self) -> None:
        if self.matrix.dim() != 2:
            raise ValueError(f"matrix: expected (n_words, dim), got shape {tuple(self.matrix.shape)}")
        if len(self.index) != self.matrix.shape[0]:
            raise ValueError(f"index: {len(self.index)} words for {self.matrix.shape[0]} rows")

    @property
    def dim(self) -> int:
        return self.matrix.shape[1]

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, word: object) -> bool:
        return word in self.index

    def __getitem__(self, word: str) -> torch.Tensor:
        return self.matrix[self.index[word]]


@dataclass(frozen=True)
class Coverage:
    """How many vocabulary tokens got a vector: ``found`` of ``total`` (specials not counted)."""

    found: int
    total: int
    missing: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if not 0 <= self.found <= self.total:
            raise ValueError(f"found: must lie in [0, total={self.total}], got {self.found}")

    @property
    def ratio(self) -> float:
        return self.found / self.total if self.total else 0.0

    def __str__(self) -> str:
        return f"{self.found}/{self.total} tokens ({100 * self.ratio:.1f}%) initialised from vectors"


def train_word2vec(
    sentences: Iterable[Sequence[str]],
    dim: int,
    *,
    window: int = 5,
    min_count: int = 1,
    epochs: int = 5,
    negative: int = 5,
    seed: int = 0,
) -> WordVectors:
    """Skip-gram word2vec (``sg=1``) with negative sampling, trained by gensim (Agarwal §2.2).

    One worker thread and a fixed seed make the vectors reproducible run to run.

    Args:
        sentences: tokenized sentences (each a sequence of tokens).
        dim: vector width; use the model's d_model to initialise its embedding.
        window: context words on each side.
        min_count: ignore words seen fewer times.
        epochs: passes over the corpus.
        negative: negative samples per positive pair.
        seed: random seed.
    """
    from gensim.models import Word2Vec  # heavy, and only `attnlab word2vec` needs it (the trainer imports this module)

    if dim < 1:
        raise ConfigError(f"dim: must be >= 1, got {dim}")
    check_vector_dim(dim, flag="dim")
    for name, value, cap, cap_name in (
        ("window", window, MAX_WINDOW, "MAX_WINDOW"),
        ("min_count", min_count, MAX_MIN_COUNT, "MAX_MIN_COUNT"),
        ("epochs", epochs, MAX_EPOCHS, "MAX_EPOCHS"),
    ):
        if not 1 <= value <= cap:
            raise ConfigError(f"{name}: must lie in [1, {cap:,}] (attnlab.limits.{cap_name}), got {value:,}")
    corpus = [list(sentence) for sentence in sentences if len(sentence) > 0]
    if not corpus:
        raise DataError("word2vec: the corpus has no tokens")
    counts = Counter(token for sentence in corpus for token in sentence)
    words = sum(1 for count in counts.values() if count >= min_count)
    check_memory(
        word2vec_memory(words, dim),
        what=f"word2vec with {words:,} words x {dim:,} dims",
        reduce=("dim (--dim)", "the vocabulary (raise min_count, --min-count)"),
    )  # before gensim allocates
    model = Word2Vec(
        vector_size=dim,
        window=window,
        min_count=min_count,
        sg=1,
        negative=negative,
        epochs=epochs,
        seed=seed,
        workers=1,
    )
    model.build_vocab(corpus)
    words = list(model.wv.index_to_key)
    if not words:  # gensim would stop in train() with "you must first build vocabulary"
        top = max(counts.values())
        raise DataError(
            f"word2vec: no word occurs at least min_count={min_count} times (the most frequent occurs {top})"
        )
    # What Word2Vec(sentences=corpus, ...) does after building the vocabulary.
    model.train(
        corpus,
        total_examples=model.corpus_count,
        total_words=model.corpus_total_words,
        epochs=model.epochs,
        start_alpha=model.alpha,
        end_alpha=model.min_alpha,
    )
    matrix = torch.from_numpy(model.wv.vectors.copy()).to(torch.float32)
    return WordVectors({word: i for i, word in enumerate(words)}, matrix)


def save_vectors(vectors: WordVectors, path: str | os.PathLike[str]) -> list[str]:
    """Write word2vec text format (with header), atomically.

    The format separates fields by spaces and words by line breaks, so a word holding either (a
    character tokenizer's " ", say) cannot be written; such words are left out.

    Returns:
        The words left out, in vector order.
    """
    kept = [(word, row) for word, row in zip(vectors.index, vectors.matrix.tolist(), strict=True) if _storable(word)]

    def write(handle: TextIO) -> None:
        handle.write(f"{len(kept)} {vectors.dim}\n")
        for word, row in kept:
            handle.write(word + " " + " ".join(repr(float(x)) for x in row) + "\n")

    atomic_write(path, write)
    return [word for word in vectors.index if not _storable(word)]


def _storable(word: str) -> bool:
    return word != "" and not any(ch in word for ch in " \n\r")


def load_vectors(path: str | os.PathLike[str]) -> WordVectors:
    """Read a word2vec text file (with header) or a GloVe file (without).

    Raises:
        DataError: missing or empty file, bytes that are not UTF-8, a line with the wrong number
        of values, a value that is not a number, a header that disagrees with the file, or a
        repeated word; the message names the file and line.
    """
    path = Path(path)
    try:
        raw = read_capped(path)
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        line = raw[: error.start].count(b"\n") + 1
        raise DataError(f"{path}:{line}: bytes that are not UTF-8") from None
    # Lines end at "\n" (or "\r\n") only: str.splitlines would also break inside a word at
    # Unicode separators such as U+2028 or U+0085, which the writer does not escape.
    lines = [line.removesuffix("\r") for line in text.split("\n")]
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start an empty one
    if not any(line.strip() for line in lines):
        raise DataError(f"{path}: empty vectors file")
    header = _header(lines[0])
    start = 1 if header else 0
    index: dict[str, int] = {}
    rows: list[list[float]] = []
    dim = header[1] if header else None
    for number, line in enumerate(lines[start:], start=start + 1):
        if not line.strip():
            raise DataError(f"{path}:{number}: empty line")
        # A word may not contain spaces in this format; every field after the first is a value.
        word, *values = line.rstrip().split(" ")
        if dim is None:
            dim = len(values)
        if len(values) != dim or dim == 0:
            raise DataError(f"{path}:{number}: expected {dim} values after the word, got {len(values)}")
        try:
            rows.append([float(v) for v in values])
        except ValueError:
            raise DataError(f"{path}:{number}: a value is not a number") from None
        if word in index:
            raise DataError(f"{path}:{number}: word {word!r} repeated (first on line {index[word] + start + 1})")
        index[word] = len(index)
    if header and header[0] != len(rows):
        raise DataError(f"{path}:1: header says {header[0]} words, the file has {len(rows)}")
    return WordVectors(index, torch.tensor(rows, dtype=torch.float32))


def _header(line: str) -> tuple[int, int] | None:
    fields = line.split()
    if len(fields) == 2 and all(f.isdigit() for f in fields):
        return int(fields[0]), int(fields[1])
    return None


def init_embedding(
    embedding: nn.Embedding,
    vocab: Mapping[str, int],
    vectors: WordVectors,
    *,
    skip: Collection[str] = (),
) -> Coverage:
    """Copy each known token's vector into its row of ``embedding``; other rows are left as they are.

    The padding row (``embedding.padding_idx``) is never written, so it stays zero.

    Args:
        embedding: the token embedding, weight (V, d_model).
        vocab: token -> row id (e.g. ``Tokenizer.vocab``).
        vectors: the word vectors; their width must equal d_model.
        skip: tokens neither copied nor counted (e.g. the special tokens).

    Returns:
        the coverage: how many of the counted tokens had a vector, and which did not.

    Raises:
        ConfigError: the widths differ, or a vocabulary id is outside the embedding.
    """
    rows, width = embedding.weight.shape
    if vectors.dim != width:
        raise ConfigError(f"embedding: vectors have dim {vectors.dim}, the embedding has d_model={width}")
    found, missing = 0, []
    with torch.no_grad():
        for token, row in vocab.items():
            if token in skip or row == embedding.padding_idx:
                continue
            if not 0 <= row < rows:
                raise ConfigError(f"embedding: token {token!r} has id {row}, outside [0, {rows})")
            if token in vectors:
                embedding.weight[row] = vectors[token].to(embedding.weight.dtype)
                found += 1
            else:
                missing.append(token)
    return Coverage(found=found, total=found + len(missing), missing=tuple(sorted(missing)))
