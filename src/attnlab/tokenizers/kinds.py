"""The five tokenizer kinds, each a small builder over Hugging Face ``tokenizers``.

Tokenization splits a text into tokens; the set of distinct tokens is the vocabulary, and a
look-up table maps each token to an id (Agarwal §2.1, Defs. 2.1-2.2). The kinds follow the seed's
progression:

=========  =====================================================================================
word       split on whitespace: "Isn't this project amazing?" -> ["Isn't", ..., "amazing?"]
rule       also split punctuation and English contractions (Agarwal §2.1):
           -> ["Is", "n't", "this", "project", "amazing", "?"]
char       one token per Unicode code point; characters never seen in training fall back to
           their UTF-8 bytes (``<0xF0>`` ...), so nothing becomes UNK and decode is exact
wordpiece  BERT's subwords ("non", "##sense"), learned by the WordPiece trainer
bpe        byte-level BPE (GPT-2): merges learned over the 256 byte symbols; decode is exact
=========  =====================================================================================

Every builder puts the special tokens first, so PAD has id 0 (the models' default ``pad_id``).
Merges, vocabularies and splitting all come from the library's pre-tokenizers, models and
trainers; nothing here loops over merges by hand.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable

from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from attnlab.limits import MAX_VOCAB_SIZE

__all__ = [
    "SPECIAL_TOKENS",
    "KINDS",
    "LEARNED_KINDS",
    "EXTERNAL_KIND",
    "BYTE_TOKENS",
    "build",
    "check_build_options",
    "infer_kind",
]

SPECIAL_TOKENS: dict[str, str] = {
    "pad": "[PAD]",
    "unk": "[UNK]",
    "bos": "[BOS]",
    "eos": "[EOS]",
    "cls": "[CLS]",
    "sep": "[SEP]",
}
"""role -> token text, in id order: PAD=0, UNK=1, BOS=2, EOS=3, CLS=4, SEP=5."""

UNK = SPECIAL_TOKENS["unk"]
SPECIALS = list(SPECIAL_TOKENS.values())

BYTE_TOKENS = [f"<0x{byte:02X}>" for byte in range(256)]
"""The char kind's fallback tokens, in the spelling HF's ``ByteFallback`` decoder understands."""

EXTERNAL_KIND = "hf"
"""The kind of a loaded tokenizer.json that none of the five builders could have made."""

# "n't" and the clitics 's 're 've 'll 'd 'm become their own tokens (Penn Treebank style), then
# every other non-word, non-space character stands alone. The contraction alternative comes
# first so that the apostrophe of "isn't" is not split off as punctuation.
RULE_PATTERN = r"(?i:n't|'(?:s|re|ve|ll|d|m))\b|[^\w\s]"
CHAR_PATTERN = r"[\s\S]"  # any single code point, newlines included

Builder = Callable[[Iterable[str], int], HFTokenizer]


def _word_level(pre_tokenizer: pre_tokenizers.PreTokenizer, corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    tokenizer = HFTokenizer(models.WordLevel(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizer
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def build_word(corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Whitespace-separated words; the ``vocab_size`` most frequent ones, the rest are UNK."""
    return _word_level(pre_tokenizers.WhitespaceSplit(), corpus, vocab_size)


def build_rule(corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Words, punctuation and contractions as separate tokens (Agarwal §2.1)."""
    split = pre_tokenizers.Split(Regex(RULE_PATTERN), behavior="isolated")
    return _word_level(pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), split]), corpus, vocab_size)


def build_char(corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Code points, the ``vocab_size`` most frequent in the corpus, plus 256 byte-fallback tokens.

    The corpus characters are counted by HF's WordLevel trainer over a one-code-point split; the
    final model is a merge-free BPE with ``byte_fallback`` so that any character outside the
    vocabulary is spelled as its UTF-8 bytes instead of UNK, and decode(encode(x)) == x.
    """
    counter = HFTokenizer(models.WordLevel(unk_token=UNK))
    counter.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_PATTERN), behavior="isolated")
    trainer = trainers.WordLevelTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    counter.train_from_iterator(corpus, trainer)
    learned = sorted(counter.get_vocab().items(), key=lambda item: item[1])
    vocab = {token: index for index, token in enumerate(SPECIALS + BYTE_TOKENS)}
    for token, _ in learned:
        vocab.setdefault(token, len(vocab))
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(CHAR_PATTERN), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_special_tokens(SPECIALS)
    return tokenizer


def build_wordpiece(corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """BERT-style WordPiece over whitespace-and-punctuation words; continuation pieces start ##."""
    tokenizer = HFTokenizer(models.WordPiece(unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tokenizer.train_from_iterator(corpus, trainer)
    # The trainer learns the same pieces every time but numbers them in hash-map order, which
    # changes from call to call: renumber them (specials first, then by the piece) so that a corpus
    # always gives the same ids, in every run and on every rank.
    learned = tokenizer.get_vocab()
    pieces = SPECIALS + sorted(piece for piece in learned if piece not in SPECIALS)
    tokenizer.model = models.WordPiece({piece: index for index, piece in enumerate(pieces)}, unk_token=UNK)
    return tokenizer


def build_bpe(corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Byte-level BPE: all 256 bytes are in the alphabet, so no input is ever UNK."""
    tokenizer = HFTokenizer(models.BPE())
    # No prefix space: it would add a leading " " that decode cannot tell from a real one.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


KINDS: dict[str, Builder] = {
    "word": build_word,
    "rule": build_rule,
    "char": build_char,
    "wordpiece": build_wordpiece,
    "bpe": build_bpe,
}
"""Registry: kind name -> builder(corpus lines, vocab_size) -> HF tokenizer."""

LEARNED_KINDS = frozenset({"wordpiece", "bpe"})
"""The kinds whose pieces are learned from a corpus (merges, subwords): trained on one short text
they make each of its words one token, which shows nothing of how the kind splits."""


def build(kind: str, corpus: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a tokenizer of ``kind`` on ``corpus`` (an iterable of lines)."""
    check_build_options(kind, vocab_size)
    return KINDS[kind](corpus, vocab_size)


def check_build_options(kind: str, vocab_size: int) -> None:
    """The checks of :func:`build`, for callers that validate a config before reading a corpus."""
    if kind not in KINDS:
        raise ValueError(f"kind: unknown tokenizer kind {kind!r}; choose one of {', '.join(KINDS)}")
    if vocab_size < len(SPECIALS) + 1:
        raise ValueError(f"vocab_size: must be at least {len(SPECIALS) + 1}, got {vocab_size}")
    if vocab_size > MAX_VOCAB_SIZE:  # the trainers allocate per id: 10**12 aborted the process
        raise ValueError(
            f"vocab_size: {vocab_size:,} is more than the cap of {MAX_VOCAB_SIZE:,} (attnlab.limits.MAX_VOCAB_SIZE)"
        )


def infer_kind(tokenizer: HFTokenizer) -> str:
    """Which builder made ``tokenizer``, read from its components; ``hf`` when none did.

    HF's tokenizer.json has no room for extra keys, so the kind is recognised on load instead of
    being stored.
    """
    # The model's type from its class, the pre-tokenizer from its own small JSON: the whole
    # tokenizer's JSON (a pretrained vocabulary and merges) would be tens of MB of Python objects.
    model_type = type(tokenizer.model).__name__
    pre_component = tokenizer.pre_tokenizer
    pre = json.loads(pre_component.__getstate__()) if pre_component is not None else {}
    pre_type = pre.get("type")
    if model_type == "WordPiece":
        return "wordpiece"
    if model_type == "BPE" and pre_type == "ByteLevel":
        return "bpe"
    if model_type == "BPE" and tokenizer.model.byte_fallback and _split_pattern(pre) == CHAR_PATTERN:
        return "char"
    if model_type == "WordLevel" and pre_type == "WhitespaceSplit":
        return "word"
    if model_type == "WordLevel" and pre_type == "Sequence":
        if any(_split_pattern(step) == RULE_PATTERN for step in pre.get("pretokenizers", [])):
            return "rule"
    return EXTERNAL_KIND


def _split_pattern(pre: dict) -> str | None:
    if pre.get("type") != "Split":
        return None
    return (pre.get("pattern") or {}).get("Regex")
