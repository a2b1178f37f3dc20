"""The task-properties table agrees with the task classes it describes."""

import inspect

from attnlab.nn import MODELS
from attnlab.tasks import TASKS, Vocab
from attnlab.tasks.codec import FIRST_SYMBOL_ID, TextCodec
from attnlab.tasks.factory import TASK_PROPERTIES, TEXT_TASK_EXTRAS, build_task


def _task_class(name):
    factory = TASKS[name]
    return getattr(factory, "func", factory)


def test_every_task_has_one_row_with_its_class_kind_and_a_model_kind():
    assert set(TASK_PROPERTIES) == set(TASKS)
    for name, properties in TASK_PROPERTIES.items():
        assert properties.name == name
        assert properties.kind == _task_class(name).kind
        assert properties.model_kind in MODELS


def test_text_tasks_are_the_ones_built_with_a_tokenizer():
    for name, properties in TASK_PROPERTIES.items():
        takes_tokenizer = "tokenizer" in inspect.signature(_task_class(name)).parameters
        assert properties.text == takes_tokenizer, name
    assert set(TEXT_TASK_EXTRAS) == {"translation", "lm"}  # sentences' tokenizer is pretrained


def test_a_synthetic_codec_skips_exactly_the_specials():
    task, _ = build_task({"name": "reverse", "max_train_length": 4})
    assert task.vocab.tokens[:FIRST_SYMBOL_ID] == Vocab.of("").tokens
    codec = TextCodec(task, None)
    assert set(codec.vocabulary()) == set(task.vocab.tokens[FIRST_SYMBOL_ID:])
    assert codec.decode(codec.encode("abc")) == "abc"
