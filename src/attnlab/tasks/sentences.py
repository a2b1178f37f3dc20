"""``sentences``: texts for a sentence encoder (task kind ``embedding``), as BERT reads them.

A sentence encoder is not trained here; the task says how a text becomes the model's input and,
when a text file is given, which texts to look at (plain text, one per non-empty line, the same
format and errors as :func:`attnlab.tasks.text.read_lines`).

Encoding is BERT's single-sentence template: ``[CLS] tokens [SEP]``, all of token type 0. A text
with more than ``max_tokens - 2`` tokens is cut to that many before ``[SEP]`` is added, as
sentence-transformers does (its ``max_seq_length``). The sentence embedding is read from the last
hidden states by ``pooling``: ``mean`` over the real tokens (all-MiniLM-L6-v2) or ``first``, the
``[CLS]`` position.

Splits: the lines of ``text_file`` are dealt to train/valid/test by the seeded hash of
:func:`attnlab.tasks.base.split_of` (no text in two splits); without a file every split is empty.
The length-generalisation split is always empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from attnlab.errors import ConfigError
from attnlab.tasks.base import Example, SplitAccessors, check_split_name, split_of
from attnlab.tasks.text import MAX_LINE_CHARS, read_lines
from attnlab.tokenizers import Tokenizer

__all__ = ["SentencesTask", "SENTENCE_POOLINGS"]

SENTENCE_POOLINGS = ("mean", "first")
"""How a sentence embedding is read from the last hidden states: ``mean`` or ``first`` ([CLS])."""


@dataclass(frozen=True)
class SentencesTask(SplitAccessors):
    """Texts for a sentence encoder (see the module docstring).

    Attributes:
        tokenizer: a WordPiece tokenizer with ``[CLS]``, ``[SEP]`` and ``[PAD]`` in its vocabulary.
        text_file: optional texts, one per line.
        max_tokens: the longest input in tokens, ``[CLS]`` and ``[SEP]`` included.
        pooling: ``mean`` or ``first``.
        seed: the seed of the split hash.
    """

    tokenizer: Tokenizer
    text_file: str | os.PathLike[str] | None = None
    max_tokens: int = 512
    pooling: str = "mean"
    seed: int = 0

    kind = "embedding"

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, Tokenizer):
            raise ConfigError(f"tokenizer: expected an attnlab Tokenizer, got {type(self.tokenizer).__name__}")
        if self.max_tokens < 3:
            raise ConfigError(f"max_tokens: must be >= 3 ([CLS], one token, [SEP]), got {self.max_tokens}")
        if self.pooling not in SENTENCE_POOLINGS:
            raise ConfigError(f"pooling: unknown {self.pooling!r}; allowed: {', '.join(SENTENCE_POOLINGS)}")
        for role in ("cls", "sep", "pad"):
            if self.tokenizer.special_ids[role] >= self.vocab_size:
                raise ConfigError(f"tokenizer: has no [{role.upper()}] token in its own vocabulary")

    @property
    def vocab_size(self) -> int:
        """The tokenizer's own vocabulary (what the checkpoint's embedding covers), without the
        BOS/EOS tokens that attnlab appends to a tokenizer lacking them: text never encodes to those."""
        return self.tokenizer.hf.get_vocab_size(with_added_tokens=False)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.cls_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.sep_id

    def frame(self, ids: list[int]) -> list[int]:
        """``[CLS] ids [SEP]``, cut to ``max_tokens`` positions."""
        return [self.tokenizer.cls_id, *ids[: self.max_tokens - 2], self.tokenizer.sep_id]

    def encode(self, text: str) -> list[int]:
        """The model's input ids for ``text``."""
        return self.frame(self.tokenizer.encode(text))

    def split(self, name: str) -> list[Example]:
        check_split_name(name)
        if self.text_file is None or name == "length_generalisation":
            return []
        texts = read_lines(self.text_file, max_line_chars=MAX_LINE_CHARS).items
        return [self._example(text) for text in texts if split_of(self.seed, text) == name]

    def _example(self, text: str) -> Example:
        source = tuple(self.encode(text))
        return Example(source=source, length=len(source) - 2)
