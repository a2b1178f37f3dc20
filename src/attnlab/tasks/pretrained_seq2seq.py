"""``pretrained_seq2seq``: text for a pretrained encoder-decoder (task kind ``seq2seq``).

A pretrained encoder-decoder (T5, BART, Marian, ...) is not trained here; the task says how its
tokenizer's special roles map onto the model: the decoder's start id (``start``, the ``BOS`` of
``tgt_in`` = start + target, as transformers' ``decoder_start_token_id``), the end of sequence,
the padding id, and whether the tokenizer puts a BOS before every text (BART's ``<s>``; T5 and
Marian put none). A source reads ``[bos] x EOS`` and a target ``[bos] y``, so that ``tgt_in`` =
start + ``[bos] y`` and ``tgt_out`` = ``[bos] y EOS``: the inputs and labels transformers' models
are trained on.

When a pairs file is given (``text_file``: ``source<TAB>target`` per line, the format and errors
of :func:`attnlab.tasks.text.read_parallel`), every split holds all its pairs: they are scored
(head importance, ablation), never trained on. Without one every split is empty.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from attnlab.tasks.base import Example, SplitAccessors, check_split_name
from attnlab.tasks.pretrained_lm import check_special_ids, pretrained_vocab_size
from attnlab.tasks.text import MAX_LINE_CHARS, read_parallel
from attnlab.tokenizers import Tokenizer

__all__ = ["PretrainedSeq2SeqTask"]


@dataclass(frozen=True)
class PretrainedSeq2SeqTask(SplitAccessors):
    """Text for a pretrained encoder-decoder (see the module docstring).

    Attributes:
        tokenizer: the model's tokenizer (source and target share it).
        max_tokens: the longest source, and the longest target.
        eos: the end-of-sequence id (a source's last id; generation stops there).
        pad: the padding id (masked in the source).
        start: the decoder's first input id (transformers' ``decoder_start_token_id``).
        bos: the id put before every text, or -1 (the tokenizer puts none).
        text_file: optional ``source<TAB>target`` pairs (for ``heads``, ``eval``).
        model_vocab: the model's embedding rows where they differ from the tokenizer's (0: the same).
    """

    tokenizer: Tokenizer
    max_tokens: int
    eos: int
    pad: int
    start: int
    bos: int = -1
    text_file: str | os.PathLike[str] | None = None
    model_vocab: int = 0

    kind = "seq2seq"

    def __post_init__(self) -> None:
        check_special_ids(self, ("eos", "pad", "start"))

    @property
    def vocab_size(self) -> int:
        return pretrained_vocab_size(self)

    @property
    def pad_id(self) -> int:
        return self.pad

    @property
    def bos_id(self) -> int:
        """The first id of ``tgt_in``: the decoder's start id."""
        return self.start

    @property
    def eos_id(self) -> int:
        return self.eos

    def frame(self, ids: list[int]) -> list[int]:
        """``bos ids`` where the tokenizer puts a bos before a text, else the ids as they are."""
        return [self.bos, *ids] if self.bos >= 0 else list(ids)

    @property
    def generation_context(self) -> int:
        """The most positions the decoder's start and its output may take (``max_tokens``)."""
        return self.max_tokens

    @property
    def generation_banned(self) -> tuple[int, ...]:
        """Ids a decoded output never holds: none (the model's own distribution, as it is)."""
        return ()

    def scoring(self, path: str | os.PathLike[str]) -> PretrainedSeq2SeqTask:
        """This task with the pairs of ``path`` in every split (checked now: a bad line is one error)."""
        read_parallel(path, max_line_chars=MAX_LINE_CHARS)
        return dataclasses.replace(self, text_file=path)

    def split(self, name: str) -> list[Example]:
        check_split_name(name)
        if self.text_file is None or name == "length_generalisation":
            return []
        pairs = read_parallel(self.text_file, max_line_chars=MAX_LINE_CHARS).items
        return [self._example(source, target) for source, target in pairs]

    def _example(self, source: str, target: str) -> Example:
        src = self.frame(self.tokenizer.encode(source))[: self.max_tokens - 1] + [self.eos]
        tgt = self.frame(self.tokenizer.encode(target))[: self.max_tokens - 1]
        return Example(source=tuple(src), target=tuple(tgt), length=len(src) - 1)
