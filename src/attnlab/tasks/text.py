"""Text tasks from the user's files: ``translation`` (parallel TSV) and ``lm`` (plain text).

File formats, both UTF-8:

* parallel TSV: one pair per line, ``source<TAB>target``; exactly one tab, both sides non-empty.
* plain text: one example per non-empty line; blank lines separate paragraphs and carry no text.

A bad file is an error that names the file and the line (:class:`attnlab.errors.DataError`): an
empty file, bytes that are not UTF-8, a missing or extra tab, an empty side, a line longer than
``max_line_chars``. Nothing is dropped silently: with ``skip_bad_lines=True`` bad lines are
skipped and counted in :attr:`Lines.skipped` instead, and the CLI prints the count.

Token encoding: the tokenizer's ids. Translation: source = tokens + EOS, target = tokens
(``tgt_in`` = BOS + target, ``tgt_out`` = target + EOS, built by batching). LM: target = tokens,
so a ``DecoderOnly`` model reads BOS + tokens and predicts tokens + EOS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from attnlab.errors import ConfigError, DataError, UsageError
from attnlab.reading import read_capped
from attnlab.tasks.base import Example, SplitAccessors, check_split_name, split_of
from attnlab.tokenizers import Tokenizer

__all__ = ["BadLine", "Lines", "read_lines", "read_parallel", "TranslationTask", "LMTask"]

MAX_LINE_CHARS = 10_000


@dataclass(frozen=True)
class BadLine:
    """A line that was skipped, and why."""

    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class Lines:
    """What a reader kept: ``items`` with their 1-based ``numbers``, and the ``skipped`` lines."""

    items: tuple = ()
    numbers: tuple[int, ...] = ()
    skipped: tuple[BadLine, ...] = field(default=())


def _raw_lines(path: Path) -> list[bytes]:
    try:
        data = read_capped(path)
    except OSError as error:
        raise DataError(f"{path}: cannot read: {error.strerror}") from None
    if not data.strip():
        raise DataError(f"{path}: empty file")
    lines = data.split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the final newline ends the last line
    return lines


def _read(path: str | os.PathLike[str], parse, *, max_line_chars: int, skip_bad_lines: bool) -> Lines:
    if max_line_chars < 1:  # else every line would be reported as too long
        raise ConfigError(f"max_line_chars: must be >= 1, got {max_line_chars}")
    path = Path(path)
    items, numbers, skipped = [], [], []
    for number, raw in enumerate(_raw_lines(path), start=1):
        try:
            line = raw.decode("utf-8").removesuffix("\r")
            if len(line) > max_line_chars:
                raise ValueError(f"line has {len(line)} characters, more than max_line_chars={max_line_chars}")
            item = parse(line)
        except (UnicodeDecodeError, ValueError) as error:
            reason = "bytes that are not UTF-8" if isinstance(error, UnicodeDecodeError) else str(error)
            if not skip_bad_lines:
                raise DataError(f"{path}:{number}: {reason} (pass --skip-bad-lines to skip such lines)") from None
            skipped.append(BadLine(str(path), number, reason))
            continue
        if item is not None:
            items.append(item)
            numbers.append(number)
    if not items:
        raise DataError(f"{path}: no usable line" + (f" ({len(skipped)} bad lines skipped)" if skipped else ""))
    return Lines(tuple(items), tuple(numbers), tuple(skipped))


def _parse_pair(line: str) -> tuple[str, str]:
    tabs = line.count("\t")
    if tabs == 0:
        raise ValueError("missing tab: expected 'source<TAB>target'")
    if tabs > 1:
        raise ValueError(f"{tabs} tabs: expected exactly one, 'source<TAB>target'")
    source, target = line.split("\t")
    if not source.strip() or not target.strip():
        raise ValueError("empty source or target")
    return source, target


def _parse_text(line: str) -> str | None:
    return line if line.strip() else None


def read_parallel(
    path: str | os.PathLike[str], *, max_line_chars: int = MAX_LINE_CHARS, skip_bad_lines: bool = False
) -> Lines:
    """(source, target) pairs from a ``source<TAB>target`` file. Raises DataError on a bad line."""
    return _read(path, _parse_pair, max_line_chars=max_line_chars, skip_bad_lines=skip_bad_lines)


def read_lines(
    path: str | os.PathLike[str], *, max_line_chars: int = MAX_LINE_CHARS, skip_bad_lines: bool = False
) -> Lines:
    """The non-empty lines of a plain-text file. Raises DataError on a bad line."""
    return _read(path, _parse_text, max_line_chars=max_line_chars, skip_bad_lines=skip_bad_lines)


@dataclass(frozen=True)
class _TextTask(SplitAccessors):
    """Files per split, a tokenizer, and the length rule shared by the text tasks.

    Attributes:
        train_file: the training file.
        valid_file, test_file: their files; when absent they are carved out of ``train`` by a seeded hash
            of the source text (80/10/10), so that no source is in two splits.
        tokenizer: turns each text into ids.
        max_train_length: L in tokens (without EOS); train/valid/test keep examples of length
            <= L and the length-generalisation split takes test examples of length in (L, 2L].
            None keeps everything and leaves that split empty.
        max_line_chars: longer lines are bad lines.
        skip_bad_lines: skip and count bad lines instead of failing.
        seed: the seed of the carving hash.
    """

    train_file: str | os.PathLike[str]
    tokenizer: Tokenizer
    valid_file: str | os.PathLike[str] | None = None
    test_file: str | os.PathLike[str] | None = None
    max_train_length: int | None = None
    max_line_chars: int = MAX_LINE_CHARS
    skip_bad_lines: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.tokenizer, Tokenizer):
            raise ConfigError(f"tokenizer: expected an attnlab Tokenizer, got {type(self.tokenizer).__name__}")
        if self.max_train_length is not None and self.max_train_length < 1:
            raise ConfigError(f"max_train_length: must be >= 1, got {self.max_train_length}")
        if self.max_line_chars < 1:
            raise ConfigError(f"max_line_chars: must be >= 1, got {self.max_line_chars}")

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_id

    @property
    def bos_id(self) -> int:
        return self.tokenizer.bos_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id

    def skipped(self) -> tuple[BadLine, ...]:
        """Every bad line skipped in the split files (empty unless ``skip_bad_lines``)."""
        paths = [p for p in (self.train_file, self.valid_file, self.test_file) if p is not None]
        return tuple(bad for p in paths for bad in self._read(p).skipped)

    def split(self, name: str) -> list[Example]:
        """The examples of ``name``; see the class docstring for what goes where."""
        check_split_name(name)
        L = self.max_train_length
        file_split = "test" if name == "length_generalisation" else name
        examples = [self._example(item) for item in self._items(file_split)]
        if L is None:
            return [] if name == "length_generalisation" else examples
        if name == "length_generalisation":
            return [e for e in examples if L < e.length <= 2 * L]
        return [e for e in examples if e.length <= L]

    def _items(self, name: str) -> list:
        files = {"train": self.train_file, "valid": self.valid_file, "test": self.test_file}
        if name != "train" and files[name] is not None:
            return list(self._read(files[name]).items)
        # A split without its own file is carved out of the training file by a seeded hash of
        # the source, so the same source can never land in two splits.
        carved = {split for split in ("valid", "test") if files[split] is None}
        items = self._read(self.train_file).items
        if name == "train":
            return [item for item in items if split_of(self.seed, self._key(item)) not in carved]
        return [item for item in items if split_of(self.seed, self._key(item)) == name]

    def _read(self, path: str | os.PathLike[str]) -> Lines:
        raise NotImplementedError

    def _key(self, item) -> str:
        raise NotImplementedError

    def _example(self, item) -> Example:
        raise NotImplementedError


@dataclass(frozen=True)
class TranslationTask(_TextTask):
    """Translate: parallel TSV files in, seq2seq examples out (see the module docstring).

    Attributes:
        target_tokenizer: the target side's tokenizer; the source ``tokenizer`` when None.
        (the rest as in the shared options above)
    """

    target_tokenizer: Tokenizer | None = None

    kind = "seq2seq"

    @property
    def target(self) -> Tokenizer:
        return self.target_tokenizer or self.tokenizer

    def _read(self, path: str | os.PathLike[str]) -> Lines:
        return read_parallel(path, max_line_chars=self.max_line_chars, skip_bad_lines=self.skip_bad_lines)

    def _key(self, item: tuple[str, str]) -> str:
        return item[0]

    def _example(self, item: tuple[str, str]) -> Example:
        source = self.tokenizer.encode(item[0])
        return Example(
            source=tuple(source) + (self.tokenizer.eos_id,),
            target=tuple(self.target.encode(item[1])),
            length=len(source),
        )


@dataclass(frozen=True)
class LMTask(_TextTask):
    """Language modelling on plain text for ``DecoderOnly`` (see the module docstring)."""

    kind = "lm"

    # ---- scoring a text file (``attnlab eval --texts``, ``attnlab heads ... --texts``) -------------

    def scored_ids(self, text: str) -> list[int]:
        """``BOS text EOS``: a line framed as the model was trained on every line (input ``BOS
        text``, targets ``text EOS``), so a file's perplexity is what ``eval`` reports on a split
        of the same lines."""
        return [self.bos_id, *self.tokenizer.encode(text), self.eos_id]

    scored_context = None
    """The most ids a scored text may have: the model's (``model.max_len``)."""

    # ---- generation (``attnlab generate``) -------------------------------------------------------

    generation_context = None
    """The most positions a prompt and its continuation may take: the model's (``model.max_len``)."""

    @property
    def generation_banned(self) -> tuple[int, ...]:
        """Ids a continuation never holds: PAD and BOS (the model was never trained to write them)."""
        return (self.pad_id, self.bos_id)

    def generation_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """``BOS text``: what the model was trained to continue.

        Raises:
            UsageError: ``chat``: a model trained here has no chat template.
        """
        if chat:
            raise UsageError("--chat: this run's task (lm) has no chat template; only pretrained_lm runs have one")
        return [self.bos_id, *self.tokenizer.encode(text)]

    def _read(self, path: str | os.PathLike[str]) -> Lines:
        return read_lines(path, max_line_chars=self.max_line_chars, skip_bad_lines=self.skip_bad_lines)

    def _key(self, item: str) -> str:
        return item

    def _example(self, item: str) -> Example:
        ids = tuple(self.tokenizer.encode(item))
        return Example(source=(), target=ids, length=len(ids))
