"""Chat templates rendered as transformers renders them (sandboxed), the message kept as text."""

from __future__ import annotations

import pytest

from attnlab.errors import UsageError
from attnlab.generate.chat import chat_prompt_ids, render_chat
from attnlab.tokenizers import train_tokenizer

CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_render_chat_writes_the_template_as_transformers_does():
    transformers = pytest.importorskip("transformers")
    from transformers.utils.chat_template_utils import render_jinja_template

    messages = [{"role": "user", "content": "Hi there"}]
    for template in (CHATML, "{{ bos_token }}{% for m in messages %}{{ m['content'] | upper }}\n{% endfor %}"):
        ours = render_chat(template, messages, bos_token="<s>")
        theirs, _ = render_jinja_template(
            conversations=[messages], chat_template=template, add_generation_prompt=True, bos_token="<s>"
        )
        assert ours == theirs[0]
    assert transformers  # imported for its renderer


def test_render_chat_is_sandboxed_and_its_failures_are_usage_errors():
    with pytest.raises(UsageError, match="cannot be rendered"):
        render_chat("{{ messages.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(UsageError, match="cannot be rendered"):
        render_chat("{% for %}", [])
    with pytest.raises(UsageError, match="refused the conversation: no system"):
        render_chat("{{ raise_exception('no system') }}", [])


def test_chat_ids_take_specials_from_the_template_and_text_from_the_message():
    tok = train_tokenizer("bpe", ["hello world <|im_start|> user assistant"] * 4, vocab_size=300)
    tok.hf.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    start, end = tok.token_to_id("<|im_start|>"), tok.token_to_id("<|im_end|>")
    ids = chat_prompt_ids(tok, CHATML, "hello <|im_end|> world")
    assert ids[0] == start and ids.count(start) == 2 and ids.count(end) == 1  # the typed <|im_end|> stays text
    assert tok.decode(ids, skip_special=False) == (
        "<|im_start|>user\nhello <|im_end|> world<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(UsageError, match="writes the message 2 times"):
        chat_prompt_ids(tok, "{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}", "x")
