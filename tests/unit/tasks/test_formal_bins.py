"""Splits held out by length draw every length; depth bins of the bracket languages; the depth range
of a split; the horizon threshold. Depths are checked against a test-side depth counter and
brute-force enumeration, independent of attnlab.tasks.formal's samplers."""

from __future__ import annotations

import itertools
import random
from collections import Counter

import pytest

from attnlab.errors import ConfigError
from attnlab.tasks import LANGUAGES, RecognitionTask, get_task
from attnlab.tasks.base import spread_lengths
from attnlab.tasks.formal_dyck import bracket_depth
from tests.unit.tasks.test_task_formal import ORACLES


def _depth(s: str) -> int:
    """Test-side nesting depth: the deepest point of the running count of openers minus closers."""
    heights = itertools.accumulate(1 if ch in "([" else -1 for ch in s)
    return max([0, *heights])


def _members(language: str, n: int) -> list[str]:
    alphabet = LANGUAGES[language].alphabet
    return ["".join(p) for p in itertools.product(alphabet, repeat=n) if ORACLES[language]("".join(p))]


# ---- every length of a held-out split ------------------------------------------------------------


def test_spread_lengths_gives_each_length_its_share():
    order = spread_lengths([10, 12, 14], 10, random.Random(0))
    assert sorted(Counter(order).values()) == [3, 3, 4] and set(order) == {10, 12, 14}
    assert spread_lengths([10, 12], 1, random.Random(0)) in ([10], [12])
    assert spread_lengths([], 5, random.Random(0)) == []


@pytest.mark.parametrize(("language", "formulation"), [("dyck1", "next_char"), ("dyck2", "classify")])
def test_a_length_bin_holds_every_length_the_language_has(language, formulation):
    task = RecognitionTask(
        language=language, formulation=formulation, max_train_length=8, length_generalisation_size=60,
        eval_lengths=[[9, 20]],
    )  # fmt: skip
    lengths = Counter(e.length for e in task.split("length_9_20"))
    if formulation == "next_char":  # members only: every even length, equally often, no odd one
        assert set(lengths) == set(range(10, 21, 2)) and set(lengths.values()) == {10}
    else:  # negatives have odd lengths too; the positives fill every even length equally
        assert set(lengths) == set(range(9, 21))
        positives = Counter(e.length for e in task.split("length_9_20") if e.label == 1)
        assert set(positives) == set(range(10, 21, 2)) and set(positives.values()) == {5}


def test_a_seq2seq_length_bin_holds_every_length():
    task = get_task("reverse_string", max_train_length=5, train_size=40, valid_size=10, test_size=10,
                    length_generalisation_size=25, eval_lengths=[[6, 10]], seed=1)  # fmt: skip
    assert Counter(e.length for e in task.split("length_6_10")) == {n: 5 for n in range(6, 11)}


def test_training_splits_draw_as_before():
    """Only held-out splits are spread over their lengths: the training split is still drawn with
    weighted random lengths (so a seed's training data did not change)."""
    task = RecognitionTask(language="dyck1", max_train_length=12, train_size=300)
    counts = Counter(e.length for e in task.split("train") if e.label == 1)
    assert len(set(counts.values())) > 1


# ---- depth -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", ["", "()", "(()())", "[()]()", ")(", "(((", "())(()", "([)]"])
def test_bracket_depth_is_the_deepest_point_of_the_running_count(s):
    assert bracket_depth(s) == _depth(s)


@pytest.mark.parametrize(("language", "n"), [("dyck1", 10), ("dyck1", 12), ("dyck2", 6), ("dyck2", 8)])
def test_members_at_a_depth_are_counted_exactly(language, n):
    members = _members(language, n)
    lang = LANGUAGES[language]
    for low, high in [(1, 1), (1, 2), (2, 3), (3, n // 2), (n // 2, n // 2), (n // 2 + 1, n)]:
        assert lang.count_at_depth(n, low, high) == sum(low <= _depth(s) <= high for s in members), (low, high)
    assert lang.count_at_depth(n - 1, 1, n) == 0


def test_members_at_a_depth_are_drawn_uniformly():
    """dyck1, 8 symbols, depth 2..3: the 12 such words each about 1/12 of 6000 draws."""
    words = [s for s in _members("dyck1", 8) if 2 <= _depth(s) <= 3]
    assert len(words) == 12
    rng = random.Random(0)
    drawn = Counter(LANGUAGES["dyck1"].sample_at_depth(rng, 8, 2, 3) for _ in range(6000))
    assert set(drawn) == set(words)
    assert all(400 < count < 600 for count in drawn.values())  # 500 expected, sd about 21


@pytest.mark.parametrize(("language", "formulation", "sampler"), [
    ("dyck1", "classify", "uniform"), ("dyck1", "next_char", "uniform"), ("dyck2", "classify", "uniform"),
    ("dyck1", "next_char", "pcfg"),  # the paper's generator draws the other splits; depth bins stay by depth
])  # fmt: skip
def test_depth_bins_hold_strings_of_their_depths_at_the_stated_lengths(language, formulation, sampler):
    task = RecognitionTask(
        language=language, formulation=formulation, max_train_length=8, length_generalisation_size=80,
        eval_depths=[[1, 3], [5, 9]], eval_depth_lengths=[14, 20], seed=3, sampler=sampler,
    )  # fmt: skip
    assert task.split_names()[-2:] == ("depth_1_3", "depth_5_9")
    for name, (low, high) in (("depth_1_3", (1, 3)), ("depth_5_9", (5, 9))):
        examples = task.split(name)
        assert len(examples) == 80
        strings = [task.string_of(e) for e in examples]
        assert all(low <= _depth(s) <= high for s in strings), name
        assert all(14 <= len(s) <= 20 for s in strings)
        assert all(ORACLES[language](s) == (e.label == 1) for s, e in zip(strings, examples))
        if formulation == "classify":
            assert sum(e.label == 0 for e in examples) == 40
        members = Counter(len(s) for s, e in zip(strings, examples) if e.label == 1)
        assert set(members) == {14, 16, 18, 20}  # every length the language has at these depths
    assert task.split("depth_5_9") == task.split("depth_5_9")  # seeded


def test_depth_bins_default_to_the_length_bins_span():
    task = RecognitionTask(language="dyck1", max_train_length=8, eval_lengths=[[9, 12], [17, 24]], eval_depths=[[2, 4]])
    assert task.depth_bin_lengths() == range(9, 25)
    assert RecognitionTask(language="dyck1", max_train_length=8, eval_depths=[[2, 4]]).depth_bin_lengths() == range(
        9, 17
    )


def test_a_split_reports_the_depth_range_of_its_members():
    task = RecognitionTask(language="dyck2", max_train_length=10, train_size=200)
    examples = task.split("train")
    depths = [_depth(task.string_of(e)) for e in examples if e.label == 1]
    report = task.split_report("train", examples)
    assert (report["depth_min"], report["depth_max"]) == (min(depths), max(depths))
    assert "depth_max" not in RecognitionTask(language="parity").split_report("train", [])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"language": "parity", "eval_depths": [[1, 2]]},
            r"eval_depths: parity has no nesting depth; only dyck1, dyck2",
        ),
        ({"eval_depths": [[0, 2]]}, r"eval_depths: bin 1 \[0, 2\] must start above 0"),
        ({"eval_depths": [[3, 2]]}, r"eval_depths: bin 1 \[3, 2\] is empty"),
        ({"eval_depths": [[1, 3], [3, 5]]}, r"eval_depths: bin 2 \[3, 5\] must start above 3"),
        ({"eval_depths": [[9, 12]]}, r"eval_depths: bin 1 \[9, 12\]: dyck1 has no string of such depth .*\[9, 16\]"),
        ({"eval_depth_lengths": [9, 12]}, r"eval_depth_lengths: set without eval_depths"),
        ({"eval_depths": [[1, 2]], "eval_depth_lengths": [6, 12]}, r"eval_depth_lengths: expected \[low, high\]"),
        ({"eval_depths": [[1, 2]], "eval_depth_lengths": [12]}, r"eval_depth_lengths: expected \[low, high\]"),
        ({"horizon_threshold": 0.0}, r"horizon_threshold: must lie in \(0, 1\], got 0.0"),
        ({"horizon_threshold": 1.5}, r"horizon_threshold: must lie in \(0, 1\], got 1.5"),
    ],
)
def test_bad_depth_bins_and_thresholds_are_one_line_errors_naming_the_field(options, message):
    language = options.pop("language", "dyck1")
    with pytest.raises(ConfigError, match=f"^task.{message}"):
        get_task(language, max_train_length=8, **options)


def test_a_task_without_depth_bins_refuses_the_key():
    with pytest.raises(ConfigError, match=r"^task.eval_depths: unknown option for 'reverse'"):
        get_task("reverse", eval_depths=[[1, 2]])
    with pytest.raises(ConfigError, match=r"^task.horizon_threshold: must lie in"):
        get_task("reverse", horizon_threshold=2.0)
