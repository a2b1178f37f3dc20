"""Chat templates: a model's chat template rendered into the prompt of a decoder-only run.

Chat templates are Jinja programs shipped with a model (a GGUF file's ``tokenizer.chat_template``).
They are rendered as ``transformers`` renders them: in Jinja's *sandboxed* environment
(``ImmutableSandboxedEnvironment``: a template cannot call arbitrary Python or change its inputs),
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a ``raise_exception``
function, and the spellings of the special tokens (``bos_token``, ``eos_token``) as variables.

The rendered text holds special tokens (``<|im_start|>``), which must become their ids, while the
person's own text must stay text (attnlab never reads a special token out of typed text; see
:mod:`attnlab.tokenizers.tokenizer`). So the template is rendered with a placeholder for each
message's content; the template's own pieces are encoded with special tokens allowed
(:meth:`Tokenizer.encode(allow_special=True) <attnlab.tokenizers.Tokenizer.encode>`) and the
content as plain text, in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from attnlab.errors import UsageError
from attnlab.tokenizers import Tokenizer

__all__ = ["render_chat", "chat_prompt_ids"]

_CONTENT = "\x00attnlab-message-content\x00"
"""Stands for a message's content while the template renders (no template writes a NUL itself)."""


def _raise(message: str) -> None:
    raise UsageError(f"--chat: the chat template refused the conversation: {message}")


def render_chat(
    template: str, messages: Sequence[dict[str, str]], *, add_generation_prompt: bool = True, **variables: Any
) -> str:
    """Render a chat template over ``messages``, as ``transformers``' ``apply_chat_template`` does.

    Args:
        template: the model's Jinja chat template.
        messages: ``{"role": ..., "content": ...}`` in order.
        add_generation_prompt: end with the text that opens the assistant's reply.
        variables: further template variables (``bos_token``, ``eos_token``).

    Returns:
        The prompt text, special tokens written out.

    Raises:
        UsageError: the template is not valid Jinja, or fails or refuses while rendering.
    """
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.globals["raise_exception"] = _raise
    environment.globals["strftime_now"] = lambda spec: datetime.now().strftime(spec)
    try:
        compiled = environment.from_string(template)
        return compiled.render(messages=list(messages), add_generation_prompt=add_generation_prompt, **variables)
    except TemplateError as error:
        raise UsageError(f"--chat: the run's chat template cannot be rendered: {error}") from None


def chat_prompt_ids(tokenizer: Tokenizer, template: str, text: str, **variables: Any) -> list[int]:
    """Token ids of the chat prompt for one user message ``text``: the template's own text with
    its special tokens as ids, ``text`` as plain text (see the module docstring).

    Args:
        tokenizer: the model's tokenizer.
        template: the model's chat template.
        text: what the user says.
        variables: further template variables (``bos_token``, ``eos_token``).

    Raises:
        UsageError: the template fails, or does not write the message's content exactly once.
    """
    rendered = render_chat(template, [{"role": "user", "content": _CONTENT}], **variables)
    pieces = rendered.split(_CONTENT)
    if len(pieces) != 2:
        raise UsageError(
            f"--chat: the run's chat template writes the message {len(pieces) - 1} times, not once; "
            "attnlab cannot tell its text from the template's"
        )
    before, after = pieces
    return [
        *tokenizer.encode(before, allow_special=True),
        *tokenizer.encode(text),
        *tokenizer.encode(after, allow_special=True),
    ]
