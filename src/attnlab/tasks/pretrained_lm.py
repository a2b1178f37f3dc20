"""``pretrained_lm``: text for a pretrained causal language model (task kind ``lm``).

A pretrained LM is not trained here; the task says how its tokenizer's special roles map onto the
model's vocabulary, how long a context may be, how a chat is written (the model's chat template),
and, when a text file is given, which texts to score (plain text, one per non-empty line, the same
format and errors as :func:`attnlab.tasks.text.read_lines`).

The special ids come from the model (a GGUF file's ``tokenizer.ggml.*_token_id``), not from the
spelling of tokens: SmolLM2's end of sequence is ``<|im_end|>`` (id 2), which is also its padding
id. Padding is therefore never recognised by its id: the model is given which positions are real
tokens (``DecoderOnly.forward(is_token=...)``).

Splits: the lines of ``text_file`` are dealt to train/valid/test by the seeded hash of
:func:`attnlab.tasks.base.split_of`; without a file every split is empty. The length-generalisation
split is always empty.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from attnlab.errors import ConfigError, UsageError
from attnlab.generate.chat import chat_prompt_ids
from attnlab.tasks.base import Example, SplitAccessors, check_split_name, split_of
from attnlab.tasks.text import MAX_LINE_CHARS, read_lines
from attnlab.tokenizers import Tokenizer

__all__ = ["PretrainedLMTask", "check_special_ids", "pretrained_vocab_size"]


def pretrained_vocab_size(task: Any) -> int:
    """A pretrained model's task's vocabulary: ``model_vocab`` (the model's embedding rows) where
    set, else the tokenizer's own vocabulary without the special tokens attnlab appends to a
    tokenizer lacking its spellings (text never encodes to those)."""
    return task.model_vocab or task.tokenizer.hf.get_vocab_size(with_added_tokens=False)


def check_special_ids(task: Any, roles: tuple[str, ...]) -> None:
    """The checks a pretrained model's task makes of its fields: an attnlab tokenizer, a model
    vocabulary >= 0, a context of 2 or more, each of ``roles`` an id of the vocabulary, and ``bos``
    an id or -1.

    Raises:
        ConfigError: naming the first field that fails.
    """
    if not isinstance(task.tokenizer, Tokenizer):
        raise ConfigError(f"tokenizer: expected an attnlab Tokenizer, got {type(task.tokenizer).__name__}")
    if task.model_vocab < 0:
        raise ConfigError(f"model_vocab: must be >= 0 (0: the tokenizer's vocabulary), got {task.model_vocab}")
    if task.max_tokens < 2:
        raise ConfigError(f"max_tokens: must be >= 2, got {task.max_tokens}")
    size = task.vocab_size
    for role in roles:
        if not 0 <= getattr(task, role) < size:
            raise ConfigError(f"{role}: must be a token id in [0, {size}), got {getattr(task, role)}")
    if not -1 <= task.bos < size:
        raise ConfigError(f"bos: must be a token id in [0, {size}) or -1, got {task.bos}")


@dataclass(frozen=True)
class PretrainedLMTask(SplitAccessors):
    """Text for a pretrained causal LM (see the module docstring).

    Attributes:
        tokenizer: the model's tokenizer (its own vocabulary covers the model's embedding).
        max_tokens: the longest context, prompt and generated tokens together.
        eos: the end-of-sequence id (generation stops there).
        pad: the id written at padded positions (masked; any id of the vocabulary will do).
        bos: the beginning-of-sequence id, or -1 when the model has none.
        add_bos: put ``bos`` before every text (Llama 2 does; SmolLM2 does not).
        chat_template: the model's Jinja chat template, or "" when it has none.
        text_file: optional texts, one per line (for ``eval``, ``heads``).
        seed: the seed of the split hash.
        model_vocab: the model's embedding rows where they differ from the tokenizer's own
            vocabulary (0: the same). Hugging Face checkpoints often have more (Llama 3's 256
            special tokens are added tokens; Pythia pads to 50,304 rows for 50,277 ids).
    """

    tokenizer: Tokenizer
    max_tokens: int
    eos: int
    pad: int
    bos: int = -1
    add_bos: bool = False
    chat_template: str = ""
    text_file: str | os.PathLike[str] | None = None
    seed: int = 0
    model_vocab: int = 0

    kind = "lm"

    def __post_init__(self) -> None:
        check_special_ids(self, ("eos", "pad"))
        if self.add_bos and self.bos < 0:
            raise ConfigError("add_bos: the model has no bos id")

    @property
    def vocab_size(self) -> int:
        return pretrained_vocab_size(self)

    @property
    def pad_id(self) -> int:
        return self.pad

    @property
    def bos_id(self) -> int:
        return self.bos

    @property
    def eos_id(self) -> int:
        return self.eos

    def frame(self, ids: list[int]) -> list[int]:
        """``bos ids`` when the model adds a bos, else the ids as they are."""
        return [self.bos, *ids] if self.add_bos else list(ids)

    def encode(self, text: str) -> list[int]:
        """The model's input ids for ``text``."""
        return self.frame(self.tokenizer.encode(text))

    # ---- scoring a text file (``attnlab eval --texts``, ``attnlab heads ... --texts``) -------------

    def scored_ids(self, text: str) -> list[int]:
        """The ids a text is scored on (every one after the first predicted): ``text`` framed,
        no EOS (a line of a file is not a finished document, and a chat model's EOS ends a turn)."""
        return self.encode(text)

    @property
    def scored_context(self) -> int:
        """The most ids a scored text may have (``max_tokens``)."""
        return self.max_tokens

    # ---- generation (``attnlab generate``) -------------------------------------------------------

    @property
    def generation_context(self) -> int:
        """The most positions a prompt and its continuation may take (``max_tokens``)."""
        return self.max_tokens

    @property
    def generation_banned(self) -> tuple[int, ...]:
        """Ids a continuation never holds: none. The model's own distribution is sampled as it is
        (SmolLM2's PAD id is its EOS: banning PAD would ban the end)."""
        return ()

    def generation_prompt(self, text: str, *, chat: bool = False) -> list[int]:
        """The ids the model continues: ``text`` framed (:meth:`frame`), or with ``chat`` the
        model's chat template around one user message ``text``, ready for the assistant's reply
        (:func:`attnlab.generate.chat.chat_prompt_ids`; the template writes any BOS itself).

        Raises:
            UsageError: ``chat`` and the run has no chat template, or the template fails.
        """
        if not chat:
            return self.encode(text)
        if not self.chat_template:
            raise UsageError("--chat: this run has no chat template (its task.chat_template is empty)")
        spellings = {
            f"{role}_token": self.tokenizer.id_to_token(index) or ""
            for role, index in (("bos", self.bos), ("eos", self.eos), ("pad", self.pad))
            if index >= 0
        }
        return chat_prompt_ids(self.tokenizer, self.chat_template, text, **spellings)

    def split(self, name: str) -> list[Example]:
        check_split_name(name)
        if self.text_file is None or name == "length_generalisation":
            return []
        texts = read_lines(self.text_file, max_line_chars=MAX_LINE_CHARS).items
        return [self._example(text) for text in texts if split_of(self.seed, text) == name]

    def _example(self, text: str) -> Example:
        ids = tuple(self.encode(text))[: self.max_tokens]
        return Example(source=(), target=ids, length=len(ids))
