"""Tokenizers: text in, token ids out (Agarwal §2.1), built on Hugging Face ``tokenizers``.

Five kinds (:data:`KINDS`): ``word``, ``rule``, ``char``, ``wordpiece`` and byte-level ``bpe``.
All share the special tokens PAD, UNK, BOS, EOS, CLS and SEP, save and load as tokenizer.json,
and reject text that is not valid Unicode with a ``ValueError`` (see :mod:`.tokenizer`).

Example::

    tok = train_tokenizer("rule", ["Isn't this project amazing?"], vocab_size=100)
    tok.tokenize("Isn't this project amazing?")  # ['Is', "n't", 'this', 'project', 'amazing', '?']
"""

from attnlab.tokenizers.kinds import BYTE_TOKENS, KINDS, SPECIAL_TOKENS, check_build_options, infer_kind
from attnlab.tokenizers.tokenizer import (
    SPECIAL_ALIASES,
    IdsOnlyTokenizer,
    Tokenizer,
    check_text,
    is_uncased,
    train_tokenizer,
)

__all__ = [
    "BYTE_TOKENS",
    "KINDS",
    "SPECIAL_ALIASES",
    "SPECIAL_TOKENS",
    "IdsOnlyTokenizer",
    "Tokenizer",
    "check_build_options",
    "check_text",
    "infer_kind",
    "is_uncased",
    "train_tokenizer",
]
