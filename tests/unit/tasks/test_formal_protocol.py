"""The paper's protocol for the formal languages (Bhattamishra et al. 2020): the probabilistic
grammar against its closed forms, distinct strings per split, and examples drawn afresh."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from attnlab.errors import ConfigError
from attnlab.tasks import LANGUAGES, RecognitionTask, get_task
from attnlab.tasks.base import split_of
from attnlab.tasks.formal_dyck import dyck_derivation, pcfg_depth_cdf, pcfg_expected_length, pcfg_length_variance

SAMPLES = 4000


def _depth(word: str) -> int:
    deepest = open_now = 0
    for symbol in word:
        open_now += 1 if symbol in "([" else -1
        deepest = max(deepest, open_now)
    return deepest


def _recursive_derivation(kinds: str):  # noqa: ANN202
    """The authors' recursion (Transformer-Formal-Languages' DyckLanguage.generate), the reference
    for attnlab's stack-based derivation."""
    closer = dict(zip("([", ")]"))

    def derive(rng: random.Random, p: float, q: float, budget: float, opened: int = 0) -> str:
        if opened >= budget:
            return ""
        u = rng.random()
        if u < p:
            kind = rng.choice(kinds)
            word = kind + derive(rng, p, q, budget, opened + 2) + closer[kind]
        elif u < p + q:
            word = derive(rng, p, q, budget, opened) + derive(rng, p, q, budget, opened)
        else:
            return ""
        return word if len(word) <= budget else ""

    return derive


@pytest.mark.parametrize("kinds", ["(", "(["])
@pytest.mark.parametrize(("p", "q", "budget"), [(0.5, 0.25, 50), (0.5, 0.25, 150), (0.3, 0.2, math.inf), (0.4, 0.1, 8)])
def test_the_derivation_draws_what_the_recursion_draws(kinds, p, q, budget):
    """The same strings and the generator in the same state after each: the splits of a committed
    sweep do not move."""
    fast, reference = dyck_derivation(kinds), _recursive_derivation(kinds)
    ours, theirs = random.Random(11), random.Random(11)
    words = [fast(ours, p, q, budget) for _ in range(300)]
    assert words == [reference(theirs, p, q, budget) for _ in range(300)]
    assert ours.getstate() == theirs.getstate()
    assert any(len(word) > 10 for word in words) or budget < 10  # not only empty or tiny words


@pytest.mark.parametrize(("kinds", "p", "q"), [("(", 0.3, 0.2), ("([", 0.4, 0.1)])
def test_the_unbounded_grammar_has_the_closed_form_mean_length_and_depth(kinds, p, q):
    """E[L] = 2p / (1 - p - 2q) and E[D] = sum_d (1 - F_d): the empirical means of 4000 derivations
    (no budget, no rejection) lie within 4 standard errors."""
    derive = dyck_derivation(kinds)
    rng = random.Random(7)
    words = [derive(rng, p, q, math.inf) for _ in range(SAMPLES)]
    lengths = [len(w) for w in words]
    assert abs(statistics.fmean(lengths) - pcfg_expected_length(p, q)) < 4 * math.sqrt(
        pcfg_length_variance(p, q) / SAMPLES
    )
    depths = [_depth(w) for w in words]
    expected_depth = sum(1 - f for f in pcfg_depth_cdf(p, q, 200))
    assert abs(statistics.fmean(depths) - expected_depth) < 4 * statistics.stdev(depths) / math.sqrt(SAMPLES)
    # P(D = 0) = F_0 is the chance of the empty word
    empty = sum(w == "" for w in words) / SAMPLES
    assert abs(empty - pcfg_depth_cdf(p, q, 1)[0]) < 4 * math.sqrt(empty * (1 - empty) / SAMPLES)
    assert all(LANGUAGES["dyck1" if kinds == "(" else "dyck2"].contains(w) for w in words if w)


def test_the_closed_forms_themselves():
    assert pcfg_expected_length(0.3, 0.2) == pytest.approx(2.0)
    assert pcfg_expected_length(0.5, 0.25) == math.inf  # the paper's critical grammar
    # q = 0: S -> (S) | eps, D = L / 2 is geometric: P(D <= d) = 1 - p^(d + 1)
    assert pcfg_depth_cdf(0.4, 0.0, 3) == pytest.approx([0.6, 0.84, 0.936])


def test_the_budget_caps_the_critical_grammar_as_the_papers_generator_does():
    derive = dyck_derivation("(")
    rng = random.Random(0)
    words = [derive(rng, 0.5, 0.25, 20) for _ in range(2000)]
    assert max(len(w) for w in words) <= 20
    assert all(w == "" or LANGUAGES["dyck1"].contains(w) for w in words)


@pytest.mark.parametrize("language", list(LANGUAGES))
def test_pcfg_splits_hold_members_of_their_lengths(language):
    task = RecognitionTask(
        language=language,
        formulation="next_char",
        max_train_length=12,
        train_size=60,
        valid_size=10,
        test_size=10,
        eval_lengths=[[13, 24]],
        length_generalisation_size=20,
        sampler="pcfg",
    )
    for name in ("train", "valid", "length_13_24"):
        low, high = (1, 12) if name != "length_13_24" else (13, 24)
        strings = [task.string_of(e) for e in task.split(name)]
        assert all(LANGUAGES[language].contains(s) and low <= len(s) <= high for s in strings)


def test_the_counter_languages_draw_their_block_count_uniformly():
    task = RecognitionTask(language="anbn", formulation="next_char", max_train_length=10, sampler="pcfg")
    rng = random.Random(1)
    counts = [LANGUAGES["anbn"].grammar(rng, 0.5, 0.25, 1, 10).count("a") for _ in range(5000)]
    assert sorted(set(counts)) == [1, 2, 3, 4, 5]
    assert all(abs(counts.count(k) / 5000 - 0.2) < 4 * math.sqrt(0.2 * 0.8 / 5000) for k in range(1, 6))
    assert task.lengths("train") == range(1, 11)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"p": 0.0}, r"^task\.p: .*must be > 0"),
        ({"q": -0.1}, r"^task\.q: .*must be >= 0"),
        ({"p": 0.6, "q": 0.4}, r"^task\.q: p \+ q must be < 1"),
        ({"sampler": "grammar"}, r"^task\.sampler: unknown 'grammar'"),
    ],
)
def test_bad_grammar_options_are_one_line_naming_the_field(options, message):
    with pytest.raises(ConfigError, match=message) as caught:
        get_task("dyck1", **options)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("formulation", ["next_char", "classify"])
@pytest.mark.parametrize("sampler", ["uniform", "pcfg"])
def test_distinct_splits_hold_no_string_twice_and_share_none(formulation, sampler):
    task = RecognitionTask(
        language="dyck2",
        formulation=formulation,
        max_train_length=10,
        train_size=300,
        valid_size=40,
        test_size=40,
        eval_lengths=[[11, 16]],
        length_generalisation_size=50,
        sampler=sampler,
        distinct=True,
    )
    held = {}
    for name in ("train", "valid", "test", "length_11_16"):
        strings = [task.string_of(e) for e in task.split(name)]
        assert len(set(strings)) == len(strings), name
        held[name] = set(strings)
    names = list(held)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not held[a] & held[b], (a, b)


def test_without_distinct_a_small_split_repeats_strings():
    task = RecognitionTask(language="dyck1", formulation="next_char", max_train_length=8, train_size=200)
    strings = [task.string_of(e) for e in task.split("train")]
    assert len(set(strings)) < len(strings)


def test_a_language_too_small_for_a_distinct_split_is_an_error_naming_the_size():
    task = RecognitionTask(language="anbn", formulation="next_char", max_train_length=50, train_size=100, distinct=True)
    with pytest.raises(ConfigError, match=r"^task\.train_size: anbn has too few distinct strings of lengths 1\.\.50"):
        task.split("train")
    bins = RecognitionTask(
        language="dyck1",
        formulation="next_char",
        max_train_length=4,
        eval_lengths=[[5, 6]],
        length_generalisation_size=10,
        distinct=True,
    )
    with pytest.raises(ConfigError, match=r"^task\.length_generalisation_size: dyck1 has too few"):
        bins.split("length_5_6")


@pytest.mark.parametrize("sampler", ["uniform", "pcfg"])
def test_fresh_training_examples_repeat_with_the_rng_and_stay_in_the_train_split(sampler):
    task = RecognitionTask(language="dyck2", max_train_length=12, sampler=sampler, fresh_examples=True)
    first = task.fresh_train(random.Random("a"), 64)
    assert first == task.fresh_train(random.Random("a"), 64)
    assert first != task.fresh_train(random.Random("b"), 64)
    assert sum(e.label for e in first) == 32
    assert all(1 <= e.length <= 12 for e in first)
    # only strings of the train split: never one of valid or test
    positives = [task.string_of(e) for e in first if e.label == 1]
    assert all(split_of(task.seed, s) == "train" for s in positives)
