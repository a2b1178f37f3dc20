"""Streaming: the text of generated tokens handed out as it becomes final (``attnlab generate``
prints it as it comes; :func:`attnlab.generate.search.generate_continuations` gives the tokens
through ``on_token``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["TextStream"]


class TextStream:
    """The text of a growing token sequence, handed out piece by piece as it becomes final.

    A token of a byte-level vocabulary may hold part of a UTF-8 character; its text is held back
    (the decoded text ends with U+FFFD) until the character is complete, as Hugging Face's
    ``TextStreamer`` does.

    Args:
        decode: token ids -> text (the run's codec).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self.ids: list[int] = []
        self._shown = 0

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the text that is now final and was not returned before."""
        self.ids.extend(int(i) for i in ids)
        text = self._decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def finish(self) -> str:
        """The rest of the text (an unfinished character included, as U+FFFD)."""
        return self._take(self._decode(self.ids))

    def _take(self, text: str) -> str:
        new = text[self._shown :]
        self._shown = max(self._shown, len(text))
        return new
