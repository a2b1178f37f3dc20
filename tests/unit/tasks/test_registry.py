"""The task registry agrees with the task classes it describes."""

import inspect

from attnlab.nn import MODELS
from attnlab.tasks import TASKS, Vocab
from attnlab.tasks.codec import FIRST_SYMBOL_ID, TextCodec
from attnlab.tasks.registry import MODEL_FOR_TASK_KIND, TEXT_TASK_EXTRAS, build_task


def test_every_task_has_one_entry_under_its_name_training_a_known_model_kind():
    for name, entry in TASKS.items():
        assert entry.name == name
        assert entry.model_kind in MODELS
    assert set(MODEL_FOR_TASK_KIND.values()) <= set(MODELS)


def test_text_tasks_are_the_ones_built_with_a_tokenizer():
    for name, entry in TASKS.items():
        takes_tokenizer = "tokenizer" in inspect.signature(entry.task_class).parameters
        assert entry.text == takes_tokenizer, name
    assert set(TEXT_TASK_EXTRAS) == {"translation", "lm"}  # sentences' tokenizer is pretrained


def test_a_synthetic_codec_skips_exactly_the_specials():
    task, _ = build_task({"name": "reverse", "max_train_length": 4})
    assert task.vocab.tokens[:FIRST_SYMBOL_ID] == Vocab.of("").tokens
    codec = TextCodec(task, None)
    assert set(codec.vocabulary()) == set(task.vocab.tokens[FIRST_SYMBOL_ID:])
    assert codec.decode(codec.encode("abc")) == "abc"
