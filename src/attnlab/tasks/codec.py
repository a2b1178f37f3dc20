"""TextCodec: text <-> token ids for a task, through its tokenizer (text tasks) or its symbol vocabulary."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnlab.errors import UsageError
from attnlab.tasks.base import TASK_SPECIALS, Vocab
from attnlab.tokenizers import Tokenizer

__all__ = ["FIRST_SYMBOL_ID", "TextCodec"]

FIRST_SYMBOL_ID = len(TASK_SPECIALS)
"""The id of a synthetic task's first symbol: ids below it are the specials PAD=0, BOS=1, EOS=2."""


class TextCodec:
    """Text <-> token ids for a task: its tokenizer (text tasks) or its symbol vocabulary.

    Synthetic tasks write one symbol per character ("abc", "12+5", "(()())"); symbols may also be
    separated by spaces ("a b c"). A task with a ``frame`` (the ``sentences`` task: BERT's
    ``[CLS] ... [SEP]``) puts the tokenizer's ids in it; the others take them as they are.
    """

    def __init__(self, task: Any, tokenizer: Tokenizer | None) -> None:
        self.task, self.tokenizer = task, tokenizer
        # A task with a frame (BERT's [CLS] ... [SEP], a pretrained LM's BOS) puts the ids in it.
        self._frame: Callable[[list[int]], list[int]] = getattr(task, "frame", list)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is not None:
            return self._frame(self.tokenizer.encode(text))
        vocab: Vocab = self.task.vocab
        symbols = text.split() if " " in text.strip() else list(text.strip())
        allowed = vocab.tokens[FIRST_SYMBOL_ID:]
        for symbol in symbols:
            if symbol not in allowed:
                raise UsageError(f"input {text!r}: symbol {symbol!r} is not in the task's alphabet {' '.join(allowed)}")
        return list(vocab.encode(tuple(symbols)))

    def decode(self, ids: list[int]) -> str:
        if self.tokenizer is not None:
            return getattr(self.task, "target", self.tokenizer).decode(ids)
        return "".join(self.task.vocab.tokens[i] for i in ids)

    def vocabulary(self) -> dict[str, int]:
        """token text -> id, specials excluded (what word vectors can be looked up by)."""
        if self.tokenizer is not None:
            specials = set(self.tokenizer.special_ids.values())
            return {t: i for t, i in self.tokenizer.vocab.items() if i not in specials}
        return {t: i for i, t in enumerate(self.task.vocab.tokens) if i >= FIRST_SYMBOL_ID}

    def tokens(self, ids: list[int]) -> list[str]:
        """One label per id (for plots and the viewer)."""
        if self.tokenizer is not None:
            return [self.tokenizer.token_label(i) for i in ids]
        return [self.task.vocab.tokens[i] for i in ids]
