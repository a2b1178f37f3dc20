"""Recognition tasks against independent membership checkers (Hahn §3)."""

from __future__ import annotations

import re

import pytest

from attnlab.errors import ConfigError
from attnlab.tasks import LANGUAGES, RecognitionTask, get_task, near_misses
from attnlab.tasks.base import weigh_lengths


# Second, test-side checkers: written again here so a bug in formal.py cannot hide itself.
def _stack_balanced(s: str, pairs: dict[str, str]) -> bool:
    stack = []
    for ch in s:
        if ch in pairs:
            stack.append(pairs[ch])
        elif not stack or stack.pop() != ch:
            return False
    return not stack and len(s) > 0


ORACLES = {
    "parity": lambda s: len(s) > 0 and re.fullmatch("[01]+", s) is not None and sum(c == "1" for c in s) % 2 == 0,
    "dyck1": lambda s: set(s) <= set("()") and _stack_balanced(s, {"(": ")"}),
    "dyck2": lambda s: set(s) <= set("()[]") and _stack_balanced(s, {"(": ")", "[": "]"}),
    "anbn": lambda s: len(s) % 2 == 0 and len(s) > 0 and s == "a" * (len(s) // 2) + "b" * (len(s) // 2),
    "anbncn": lambda s: len(s) % 3 == 0 and len(s) > 0 and s == "".join(c * (len(s) // 3) for c in "abc"),
}


def _strings(task, examples):
    return [("".join(task.vocab.tokens[i] for i in e.source[:-1]), e.label, e.length) for e in examples]


@pytest.fixture(scope="module", params=list(LANGUAGES))
def task_and_splits(request):
    task = RecognitionTask(
        language=request.param,
        max_train_length=12,
        train_size=600,
        valid_size=100,
        test_size=100,
        length_generalisation_size=100,
        seed=3,
    )
    return task, {name: task.split(name) for name in ("train", "valid", "test", "length_generalisation")}


def test_labels_agree_with_an_independent_checker(task_and_splits):
    task, splits = task_and_splits
    oracle = ORACLES[task.language]
    for examples in splits.values():
        for string, label, _ in _strings(task, examples):
            assert oracle(string) == bool(label), string
            assert task.lang.contains(string) == bool(label), string


def test_every_sequence_ends_with_eos_and_classes_are_balanced(task_and_splits):
    task, splits = task_and_splits
    for examples in splits.values():
        assert all(e.source[-1] == task.eos_id and task.eos_id not in e.source[:-1] for e in examples)
        assert sum(e.label for e in examples) == len(examples) // 2


def _one_exchange_from_a_member(string, contains):
    # The Dyck languages' balanced negatives exchange two symbols of a positive, at any distance.
    return any(
        contains(string[:i] + string[j] + string[i + 1 : j] + string[i] + string[j + 1 :])
        for i in range(len(string))
        for j in range(i + 1, len(string))
    )


def test_negatives_are_near_misses(task_and_splits):
    task, splits = task_and_splits
    oracle = ORACLES[task.language]
    for string, label, _ in _strings(task, splits["train"]):
        if label == 0:
            assert (
                any(oracle(m) for m in near_misses(string, task.lang.alphabet))
                or any(
                    oracle(string[:i] + c + string[i:])  # the negative dropped a symbol
                    for i in range(len(string) + 1)
                    for c in task.lang.alphabet
                )
                or (task.language.startswith("dyck") and _one_exchange_from_a_member(string, oracle))
            ), string


def test_lengths_respect_the_split(task_and_splits):
    task, splits = task_and_splits
    L = task.max_train_length
    for name in ("train", "valid", "test"):
        assert all(1 <= length <= L and len(s) == length for s, _, length in _strings(task, splits[name]))
    assert all(L < length <= 2 * L for _, _, length in _strings(task, splits["length_generalisation"]))


def test_no_string_is_in_two_splits(task_and_splits):
    task, splits = task_and_splits
    sets = {name: {s for s, _, _ in _strings(task, ex)} for name, ex in splits.items()}
    assert not sets["train"] & sets["test"]
    assert not sets["train"] & sets["valid"]
    assert not sets["valid"] & sets["test"]
    assert sets["valid"] and sets["test"]


@pytest.mark.parametrize("language", ["parity", "dyck2"])
@pytest.mark.parametrize("name", ["valid", "test"])
def test_a_few_short_strings_do_not_fill_a_held_out_split(language, name):
    # Languages with many strings: a held-out split draws hundreds of distinct strings, and no
    # single short string (of which the split may own only one or two) is repeated into a big share.
    task = RecognitionTask(language=language, max_train_length=12, train_size=0, valid_size=400, test_size=400)
    examples = task.split(name)
    counts = {}
    for e in examples:
        counts[e.source] = counts.get(e.source, 0) + 1
    assert len(counts) > 0.6 * len(examples)
    assert max(counts.values()) <= 0.02 * len(examples)
    short = sum(e.length <= 4 for e in examples)
    assert short <= 0.05 * len(examples)


def test_length_weights_follow_the_split_share_of_the_strings():
    lengths, weights = weigh_lengths("valid", {1: 2, 2: 0, 12: 10_000, 400: 10**400}, draws=100)
    assert lengths == [1, 12, 400]
    assert weights == pytest.approx([0.2, 100, 100])  # 10% of 2 strings; capped at the draws
    assert weigh_lengths("length_generalisation", {13: 50}, draws=100)[1] == [50]


def test_same_seed_same_data_other_seed_other_data():
    a = RecognitionTask(language="dyck2", train_size=50, seed=1).train()
    assert a == RecognitionTask(language="dyck2", train_size=50, seed=1).train()
    assert a != RecognitionTask(language="dyck2", train_size=50, seed=2).train()


def test_counts_and_encoding():
    parity = RecognitionTask(language="parity")
    assert [parity.num_positive(n) for n in range(1, 5)] == [1, 2, 4, 8]
    assert parity.num_distinct(4) == 16
    assert parity.encode("1011", 0).source == (4, 3, 4, 4, 2)
    dyck2 = RecognitionTask(language="dyck2")
    assert [dyck2.num_positive(n) for n in (1, 2, 4, 6)] == [0, 2, 8, 40]
    for n in (2, 4, 6):  # the formula agrees with brute-force enumeration
        assert len(list(dyck2.lang.positives(n))) == dyck2.num_positive(n)
    assert RecognitionTask(language="anbncn").num_positive(9) == 1


def test_too_small_a_language_is_a_clear_error():
    with pytest.raises(ConfigError, match="too few"):
        RecognitionTask(language="anbn", max_train_length=4).train()
    with pytest.raises(ConfigError, match="unknown language"):
        RecognitionTask(language="abc")
    with pytest.raises(ConfigError, match="unknown option"):
        get_task("parity", size=3)
