"""``Tokenizer``: text <-> token ids, one class for every kind (Agarwal §2.1).

A thin wrapper over a Hugging Face ``tokenizers.Tokenizer`` that adds what the rest of attnlab
relies on: the six special tokens with fixed roles, tokenizer.json and BERT vocab.txt I/O with
errors that name the file and line, and a documented policy for text that is not valid Unicode.

Policy for invalid text: a Python ``str`` holding a lone surrogate (U+D800..U+DFFF, e.g. from
``surrogateescape`` decoding of bytes that are not UTF-8) is **rejected** with
:class:`attnlab.errors.DataError`, a ``ValueError`` that names the offending position. Nothing is
replaced silently, so a model never trains on U+FFFD that the user did not write.

Policy for special tokens in text: text is always text. The string "[PAD]" inside an input is
split like any other characters (HF's ``encode_special_tokens``), so only code that asks for
``pad_id`` etc. can put a special id into a sequence. (The word kind splits on whitespace only,
so a whole word "[PAD]" is looked up in its vocabulary and does map to PAD there.)

Policy for padding and truncation: a ``Tokenizer`` turns one text into exactly its tokens. A
Hugging Face tokenizer.json may configure a fixed padding (e.g. to 128 tokens) or truncation for
batching; both are switched off when such a file is wrapped, because attnlab pads batches and
checks lengths itself (``attnlab tokenize`` would otherwise print a tail of ``[PAD]``).

Policy for casing of a BERT vocab.txt (:func:`is_uncased`): an uncased vocabulary, one that
lowercasing leaves unchanged, gets what Hugging Face's BERT does by default (lowercase, strip
accents); a cased one keeps case and accents. ``lowercase=`` overrides the choice.

Policy for damaged files: a tokenizer.json whose bytes are not UTF-8, not JSON or not a tokenizer
is a :class:`attnlab.reading.DamagedFileError` (exit code 3, as a damaged config.json or
safetensors file is; also a ``DataError``), naming the file; one that cannot be read at all
(missing, permission denied) is a ``DataError`` (exit 2) naming the file and the errno.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers

from attnlab.errors import DataError, UsageError
from attnlab.reading import DamagedFileError, describe_os_error, read_capped
from attnlab.tokenizers.kinds import EXTERNAL_KIND, KINDS, SPECIAL_TOKENS, build, infer_kind

__all__ = ["Tokenizer", "train_tokenizer", "check_text", "is_uncased", "SPECIAL_ALIASES"]

SPECIAL_ALIASES: dict[str, tuple[str, ...]] = {
    "pad": ("[PAD]", "<pad>", "<PAD>"),
    "unk": ("[UNK]", "<unk>", "<UNK>"),
    "bos": ("[BOS]", "<s>", "<bos>", "<BOS>", "<|startoftext|>"),
    "eos": ("[EOS]", "</s>", "<eos>", "<EOS>", "<|endoftext|>"),
    "cls": ("[CLS]", "<cls>", "<CLS>", "<s>"),  # RoBERTa frames a text as <s> ... </s>
    "sep": ("[SEP]", "<sep>", "<SEP>", "</s>"),
}
"""role -> the spellings recognised in a foreign tokenizer.json or vocab.txt, preferred first."""


SPECIAL_SHAPE = re.compile(r"\[[^\[\]\s]+\]|<[^<>\s]+>")
"""A whole token written like a special one: ``[CLS]``, ``[unused0]``, ``<s>``, ``<pad>``."""


def is_uncased(pieces: Iterable[str]) -> bool:
    """True when lowercasing changes no piece of a vocabulary: a BERT "uncased" vocabulary.

    Special-looking tokens (``[CLS]``, ``[UNK]``, ``<s>``: see :data:`SPECIAL_SHAPE`) are left
    out, since uncased vocabularies spell them in capitals too. Lowercasing is the ``tokenizers``
    library's own (``normalizers.Lowercase``), the same one its ``BertNormalizer`` applies to text,
    so symbols such as "ℝ" that have no lower-case form do not make a vocabulary cased.

    Args:
        pieces: the vocabulary's tokens (continuation pieces with their ``##``).

    Returns:
        True for an uncased vocabulary (also one with no letters at all), False for a cased one.
    """
    words = "\n".join(piece for piece in pieces if not SPECIAL_SHAPE.fullmatch(piece))
    return normalizers.Lowercase().normalize_str(words) == words


def check_text(text: str) -> str:
    """Return ``text`` if it is valid Unicode; raise DataError (a ValueError) on a lone surrogate."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        code = ord(text[error.start])
        raise DataError(f"text is not valid Unicode: lone surrogate U+{code:04X} at character {error.start}") from None
    return text


def _byte_level_symbols() -> dict[str, int]:
    """GPT-2's byte-level alphabet: symbol -> the byte it stands for. Printable bytes stand for
    themselves; the others (space, control bytes, ...) map to U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + n): b for n, b in enumerate(others)}


_BYTE_OF_SYMBOL = _byte_level_symbols()
_CONTROL_ESCAPES = {c: ascii(chr(c))[1:-1] for c in [*range(32), 127]}


class Tokenizer:
    """A tokenizer of one kind (``word``, ``rule``, ``char``, ``wordpiece``, ``bpe`` or ``hf``).

    Args:
        hf: the Hugging Face tokenizer to wrap; missing special tokens are added to it.
        kind: the kind; inferred from ``hf``'s components when None.

    Every tokenizer has all six special tokens. Those made by :func:`train_tokenizer` have them at
    ids 0-5 (PAD=0); a loaded foreign file keeps its own ids and gets the missing ones appended.
    """

    def __init__(self, hf: HFTokenizer, kind: str | None = None) -> None:
        self.hf = hf
        self.kind = infer_kind(hf) if kind is None else kind
        if self.kind not in KINDS and self.kind != EXTERNAL_KIND:
            raise ValueError(f"kind: unknown tokenizer kind {self.kind!r}; choose one of {', '.join(KINDS)}")
        # Text is text: "[PAD]" typed by a user is not the PAD id (see the module docstring).
        hf.encode_special_tokens = True
        # One text in, exactly its tokens out: no fixed padding or truncation from a foreign file.
        hf.no_padding()
        hf.no_truncation()
        self._special_ids = self._resolve_specials()

    def _resolve_specials(self) -> dict[str, int]:
        # token_to_id, not get_vocab: a pretrained vocabulary as a dict is megabytes of objects.
        ids: dict[str, int] = {}
        for role, spellings in SPECIAL_ALIASES.items():
            found = next((i for i in map(self.hf.token_to_id, spellings) if i is not None), None)
            if found is None:
                self.hf.add_special_tokens([SPECIAL_TOKENS[role]])
                found = self.hf.token_to_id(SPECIAL_TOKENS[role])
            ids[role] = found
        return ids

    # ---- special ids --------------------------------------------------------------------------

    @property
    def pad_id(self) -> int:
        return self._special_ids["pad"]

    @property
    def unk_id(self) -> int:
        return self._special_ids["unk"]

    @property
    def bos_id(self) -> int:
        return self._special_ids["bos"]

    @property
    def eos_id(self) -> int:
        return self._special_ids["eos"]

    @property
    def cls_id(self) -> int:
        return self._special_ids["cls"]

    @property
    def sep_id(self) -> int:
        return self._special_ids["sep"]

    @property
    def special_ids(self) -> dict[str, int]:
        """role (pad, unk, bos, eos, cls, sep) -> id."""
        return dict(self._special_ids)

    # ---- vocabulary -------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """V: one more than the largest id, special tokens included."""
        return self.hf.get_vocab_size(with_added_tokens=True)

    @property
    def vocab(self) -> dict[str, int]:
        """token -> id, special tokens included."""
        return self.hf.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.hf.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        return self.hf.id_to_token(index)

    def token_label(self, index: int) -> str:
        """What token ``index`` stands for, readable in a plot or the viewer: for byte-level BPE
        (GPT-2's symbols, "Ġworld", "Ċ") the text of its bytes (" world", "\\n"), with bytes that
        are only part of a UTF-8 character as escapes ("\\xf0\\x9f"); other kinds' tokens as they
        are ("##ing", "[CLS]"). Control characters are escaped, so a label stays one line."""
        token = self.hf.id_to_token(index)
        if token is None:
            return "?"
        if isinstance(self.hf.decoder, decoders.ByteLevel) and all(c in _BYTE_OF_SYMBOL for c in token):
            token = bytes(_BYTE_OF_SYMBOL[c] for c in token).decode("utf-8", errors="backslashreplace")
        return token.translate(_CONTROL_ESCAPES)

    # ---- text <-> ids -------------------------------------------------------------------------

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        """Token ids of ``text``; unknown words become ``unk_id``. No BOS/EOS is added.

        Args:
            text: the text.
            allow_special: read the spellings of special tokens in ``text`` as those tokens
                (``<|im_start|>`` -> its id). Only for text attnlab wrote itself, such as a chat
                template's output: typed text is always text (see the module docstring).

        Raises:
            DataError: ``text`` holds a lone surrogate (see the module docstring).
        """
        check_text(text)
        if not allow_special:
            return self.hf.encode(text, add_special_tokens=False).ids
        self.hf.encode_special_tokens = False
        try:
            return self.hf.encode(text, add_special_tokens=False).ids
        finally:
            self.hf.encode_special_tokens = True

    def tokenize(self, text: str) -> list[str]:
        """The tokens of ``text`` as strings (byte-level BPE shows bytes as GPT-2's symbols)."""
        return self.hf.encode(check_text(text), add_special_tokens=False).tokens

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        """Text of ``ids``. With ``skip_special``, PAD, BOS, EOS, CLS and SEP are dropped (UNK stays).

        For the char and bpe kinds, ``decode(encode(x)) == x`` for every valid string ``x``.
        """
        size = self.vocab_size
        bad = [i for i in ids if not 0 <= int(i) < size]
        if bad:
            raise ValueError(f"ids: {bad[:5]} outside the vocabulary [0, {size})")
        dropped = {v for role, v in self._special_ids.items() if role != "unk"} if skip_special else set()
        kept = [int(i) for i in ids if int(i) not in dropped]
        return self.hf.decode(kept, skip_special_tokens=False)

    def lowercase_first(self) -> None:
        """Lowercase every text before the tokenizer's own normalisation (what sentence-transformers
        does with ``do_lower_case``); kept in the saved tokenizer.json."""
        own = self.hf.normalizer
        self.hf.normalizer = (
            normalizers.Lowercase() if own is None else normalizers.Sequence([normalizers.Lowercase(), own])
        )

    # ---- files ------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The Hugging Face ``tokenizer.json`` text of this tokenizer, what :meth:`from_str` and
        :meth:`load` read back (a run writes it with :meth:`attnlab.run.directory.RunDir.write_tokenizer`)."""
        return self.hf.to_str(pretty=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Read a ``tokenizer.json``: one saved by attnlab, or any Hugging Face one (kind ``hf``).

        A padding or truncation that the file configures is switched off (see the module
        docstring): ``tokenize`` and ``encode`` give the text's own tokens, never ``[PAD]``.

        Raises:
            DamagedFileError: the file is not UTF-8, not JSON, or not a tokenizer (exit 3); the
                message names the file (and the line, for JSON syntax errors).
            DataError: the file cannot be read (missing, permission denied, past the size cap).
        """
        return cls.from_str(_read_text(Path(path), damaged=DamagedFileError), source=path)

    @classmethod
    def from_str(cls, text: str, *, source: str | os.PathLike[str] = "tokenizer.json") -> Tokenizer:
        """A tokenizer from the text of a ``tokenizer.json`` (already read; ``source`` names it in errors).

        Raises:
            DamagedFileError: the text is not JSON (nested too deeply included) or not a tokenizer.
        """
        try:
            hf = HFTokenizer.from_str(text)
        except Exception as error:  # the Rust side raises a bare Exception
            # Python's parser only for the message (its line number): for a valid file it would
            # build a pretrained vocabulary's tens of MB of objects for nothing.
            _check_json(text, source)
            raise DamagedFileError(f"{source}: not a Hugging Face tokenizer.json: {error}") from None
        return cls(hf)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str | os.PathLike[str] = "tokenizer.json") -> Tokenizer:
        """A tokenizer from the bytes of a ``tokenizer.json`` (already read; ``source`` names it in errors).

        Parsed by ``tokenizers`` from the bytes themselves: no Python string of the file is made
        (for a pretrained vocabulary that string and its UTF-8 copy left some 20 MB of the heap
        behind).

        Raises:
            DamagedFileError: bytes that are not UTF-8, text that is not JSON, or JSON that is not a
                tokenizer.
        """
        try:
            hf = HFTokenizer.from_buffer(data)
        except Exception as error:  # the Rust side raises a bare Exception
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as bad:
                raise DamagedFileError(f"{source}: bytes that are not UTF-8 (offset {bad.start})") from None
            _check_json(text, source)
            raise DamagedFileError(f"{source}: not a Hugging Face tokenizer.json: {error}") from None
        return cls(hf)

    @classmethod
    def from_vocab_txt(cls, path: str | os.PathLike[str], *, lowercase: bool | None = None) -> Tokenizer:
        """A WordPiece tokenizer from a BERT ``vocab.txt`` (one token per line, id = line - 1).

        Args:
            path: the vocab.txt file.
            lowercase: lowercase and strip accents as BERT "uncased" does (Hugging Face's
                ``BertNormalizer(lowercase=True)``), or keep case and accents (False). By default
                the vocabulary's own casing decides: lowercase when it is uncased
                (:func:`is_uncased`: lowercasing changes none of its pieces), else keep case.

        Raises:
            DataError: empty file, bytes that are not UTF-8, an empty or duplicate token (with
            the file and line).
        """
        lines = _read_text(Path(path)).split("\n")
        if lines and lines[-1] == "":
            lines.pop()  # the final newline ends the last token; it does not start an empty one
        if not lines:
            raise DataError(f"{path}: empty vocabulary file")
        vocab: dict[str, int] = {}
        for number, line in enumerate(lines, start=1):
            token = line.rstrip("\r")
            if not token.strip():
                raise DataError(f"{path}:{number}: empty token")
            if token in vocab:
                raise DataError(f"{path}:{number}: duplicate token {token!r} (first on line {vocab[token] + 1})")
            vocab[token] = len(vocab)
        if lowercase is None:
            lowercase = is_uncased(vocab)
        unk = next((s for s in SPECIAL_ALIASES["unk"] if s in vocab), SPECIAL_TOKENS["unk"])
        if unk not in vocab:
            vocab[unk] = len(vocab)  # WordPiece needs its UNK inside the model's own vocabulary
        hf = HFTokenizer(models.WordPiece(vocab=vocab, unk_token=unk))
        hf.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
        hf.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        hf.decoder = decoders.WordPiece()
        hf.add_special_tokens([t for t in vocab if t.startswith("[") and t.endswith("]")])
        return cls(hf, kind="wordpiece")


class IdsOnlyTokenizer(Tokenizer):
    """The stand-in for a model that ships no tokenizer: the model runs on token ids, each id
    labelled ``<i>``, and any text is refused with one error naming what is missing.

    Args:
        vocab_size: the model's vocabulary (ids 0 .. vocab_size - 1).
        missing: the error's words (which folder, which files it lacks).
    """

    def __init__(self, vocab_size: int, missing: str) -> None:
        self.missing = missing
        hf = HFTokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
        super().__init__(hf, kind=EXTERNAL_KIND)

    def encode(self, text: str, *, allow_special: bool = False) -> list[int]:
        raise UsageError(self.missing)

    def tokenize(self, text: str) -> list[str]:
        raise UsageError(self.missing)


def train_tokenizer(kind: str, corpus: Iterable[str], vocab_size: int = 8000) -> Tokenizer:
    """Train a tokenizer of ``kind`` on an iterable of lines (see :data:`KINDS`).

    Args:
        kind: ``word``, ``rule``, ``char``, ``wordpiece`` or ``bpe``.
        corpus: lines of training text; each is checked with :func:`check_text`.
        vocab_size: the largest vocabulary to learn, special tokens included (char adds 256 byte
            tokens on top).
    """
    return Tokenizer(build(kind, (check_text(line) for line in corpus), vocab_size), kind=kind)


def _read_text(path: Path, *, damaged: type[DataError] = DataError) -> str:
    """The UTF-8 text of ``path`` (within the size cap): a DataError naming the file and the errno
    where it cannot be read, a ``damaged`` error naming the line where its bytes are not UTF-8."""
    try:
        data = read_capped(path)
    except OSError as error:
        raise DataError(f"{path}: cannot read: {describe_os_error(error)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise damaged(f"{path}:{line}: bytes that are not UTF-8 (byte offset {error.start})") from None


def _check_json(text: str, source: str | os.PathLike[str]) -> None:
    """A DamagedFileError naming ``source`` and the line where ``text`` stops being JSON; nothing if it is JSON."""
    try:
        json.loads(text)
    except json.JSONDecodeError as error:
        raise DamagedFileError(f"{source}:{error.lineno}: not valid JSON: {error.msg}") from None
    except RecursionError:
        raise DamagedFileError(f"{source}: not valid JSON: nested too deeply") from None
