"""The next_char formulation, length bins, balanced Dyck negatives, split statistics and baselines.

References are independent of attnlab.tasks.formal: members are enumerated by brute force with the
test-side oracles of test_task_formal, and losses are recomputed in float64 from the formula.
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch
from torch import nn

from attnlab.errors import AttnlabWarning, ConfigError
from attnlab.evaluation.evaluate import evaluate, next_symbol_hits
from attnlab.evaluation.objectives import OBJECTIVES, SYMBOL_LOSSES, example_losses
from attnlab.experiment import LOSSES, ExperimentConfig, model_config_for_task
from attnlab.nn import build_model
from attnlab.tasks import LANGUAGES, RecognitionTask, get_task
from attnlab.tasks.base import Example, split_statistics
from attnlab.tasks.batching import collate, make_batches
from attnlab.tasks.formal_base import END
from attnlab.tasks.formal_splits import baseline_accuracy
from attnlab.tasks.registry import MODEL_FOR_TASK_KIND
from tests.unit.tasks.test_task_formal import ORACLES

# ---- next-symbol sets against brute force ---------------------------------------------------------

# language -> (longest member enumerated N, longest prefix checked m): every member that starts with
# a prefix of <= m symbols and one more symbol has a completion within N symbols, so the sets read
# off the members up to N are the true ones.
HORIZONS = {"parity": (9, 7), "dyck1": (12, 5), "dyck2": (8, 3), "anbn": (12, 5), "anbncn": (9, 2)}


def _members_up_to(language: str, longest: int) -> set[str]:
    alphabet = LANGUAGES[language].alphabet
    oracle = ORACLES[language]
    return {
        "".join(s) for n in range(1, longest + 1) for s in itertools.product(alphabet, repeat=n) if oracle("".join(s))
    }


@pytest.mark.parametrize("language", list(LANGUAGES))
def test_next_symbol_sets_equal_brute_force_over_all_continuations(language):
    longest, checked = HORIZONS[language]
    members = _members_up_to(language, longest)
    prefixes_of_members = {m[:i] for m in members for i in range(len(m) + 1)}
    alphabet = LANGUAGES[language].alphabet
    for n in range(checked + 1):
        for symbols in itertools.product(alphabet, repeat=n):
            prefix = "".join(symbols)
            brute = {c for c in alphabet if prefix + c in prefixes_of_members} | ({END} if prefix in members else set())
            assert LANGUAGES[language].next_symbols(prefix) == brute, prefix


@pytest.mark.parametrize("language", list(LANGUAGES))
def test_the_next_symbols_of_every_prefix_in_one_scan_are_those_prefix_by_prefix(language):
    """Every string up to length 8 (members, prefixes of members and dead ends alike): the one-scan
    sets (where the language has one) equal next_symbols of each prefix, itself checked above."""
    lang = LANGUAGES[language]
    for n in range(9):
        for symbols in itertools.product(lang.alphabet, repeat=n):
            string = "".join(symbols)
            expected = [lang.next_symbols(string[:t]) for t in range(n + 1)]
            assert lang.next_symbols_of_prefixes(string) == expected, string


def test_next_char_examples_encode_each_prefix_set_as_a_mask():
    task = RecognitionTask(language="dyck2", formulation="next_char", max_train_length=6, train_size=20)
    example = task.encode_next_char("([])")
    # ids: EOS=2, (=3, )=4, [=5, ]=6. Prefixes "", "(", "([", "([]", "([])".
    expected = [{3, 5}, {3, 4, 5}, {3, 5, 6}, {3, 4, 5}, {2, 3, 5}]
    assert [{i for i in range(8) if mask >> i & 1} for mask in example.next_symbols] == expected
    assert example.target == (3, 5, 6, 4) and example.source == () and example.length == 4


@pytest.mark.parametrize("language", list(LANGUAGES))
def test_next_char_splits_hold_members_only(language):
    task = RecognitionTask(
        language=language, formulation="next_char", max_train_length=12, train_size=60, test_size=30, seed=1
    )
    assert task.kind == "next_char" and RecognitionTask.kind == "recognition"
    for name in ("train", "test", "length_generalisation"):
        for example in task.split(name)[:30]:
            string = task.string_of(example)
            assert ORACLES[language](string) and example.label == 1
            assert example.next_symbols[-1] >> task.eos_id & 1  # the whole string is a member


# ---- the objective and the metric on hand-made logits -----------------------------------------------


class _FixedLogits(nn.Module):
    """A 'model' that returns given logits, whatever it reads."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, tokens, *, head_mask=None):  # noqa: ANN001
        return self.logits[: tokens.shape[0], : tokens.shape[1]]


class _ListTask:
    """A task whose one split is a given list (dyck1's vocabulary)."""

    kind = "next_char"
    pad_id, bos_id, eos_id = 0, 1, 2

    def __init__(self, examples):  # noqa: ANN001
        self.examples = examples

    def split(self, name):  # noqa: ANN001
        return self.examples


def _hand_made():
    task = RecognitionTask(language="dyck1", formulation="next_char")
    examples = [task.encode_next_char("()"), task.encode_next_char("(())")]
    batch = collate(examples, pad_id=0, bos_id=1, eos_id=2)
    B, T, V = 2, 5, 5
    wanted = torch.tensor([[(mask >> i) & 1 for i in range(V)] for row in batch.next_symbols for mask in row])
    wanted = wanted.view(B, T, V).double()
    logits = (wanted * 2 - 1) * 3.0  # +3 for every symbol that may follow, -3 for the others
    logits[:, :, :2] = 7.0  # PAD and BOS columns: never scored
    logits[1, 2, 4] = -0.5  # "(())": after "((" the model misses ")"
    logits[0, 3:, 2:] = 9.0  # padding of the first string: never scored
    return examples, batch, logits, wanted


def test_a_string_is_right_only_when_every_position_is_right():
    examples, batch, logits, _ = _hand_made()
    hits = next_symbol_hits(logits, batch.next_symbols, batch.tgt_is_token)
    assert hits.tolist() == [[True] * 5, [True, True, False, True, True]]
    result = evaluate(_FixedLogits(logits), _ListTask(examples), "test", kind="decoder_only", batch_size=8)
    assert result["accuracy"] == 0.5
    assert result["token_accuracy"] == pytest.approx(7 / 8)  # 3 + 5 real positions, one wrong
    assert result["accuracy_by_length"] == {"2": 1.0, "4": 0.0}
    assert "perplexity" not in result


def test_the_loss_is_the_binary_cross_entropy_of_the_formula_in_float64():
    _, batch, logits, wanted = _hand_made()
    z, y = logits[:, :, 2:], wanted[:, :, 2:]
    p = 1 / (1 + torch.exp(-z))
    bce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))  # float64, from the formula
    real = batch.tgt_is_token.double().unsqueeze(-1)
    model = _FixedLogits(logits)
    parts = OBJECTIVES["decoder_only"](model, batch, None, 0, 0.0)
    assert int(parts.count) == 8  # 3 + 5 positions, each scored on EOS, "(" and ")"
    assert float(parts.total) == pytest.approx(float((bce * real).sum()), rel=1e-12)
    per_example = example_losses("decoder_only", model, batch, None, 0)
    expected = (bce * real).sum((1, 2)) / batch.tgt_is_token.sum(1)
    assert torch.allclose(per_example, expected, rtol=1e-12)


def test_the_mse_loss_is_the_squared_error_of_each_sigmoid_in_float64():
    """train.loss = "mse" (Bhattamishra et al. 2020): (s(z) - y)^2 per symbol, summed, per position."""
    _, batch, logits, wanted = _hand_made()
    z, y = logits[:, :, 2:], wanted[:, :, 2:]
    squared = (1 / (1 + torch.exp(-z)) - y) ** 2
    real = batch.tgt_is_token.double().unsqueeze(-1)
    parts = OBJECTIVES["decoder_only"](_FixedLogits(logits), batch, None, 0, 0.0, loss="mse")
    assert int(parts.count) == 8
    assert float(parts.total) == pytest.approx(float((squared * real).sum()), rel=1e-12)
    assert set(SYMBOL_LOSSES) == set(LOSSES)  # the config's choices are the registry's


def test_a_tiny_decoder_learns_dyck1_next_symbols():
    torch.manual_seed(0)
    experiment = ExperimentConfig.from_dict(
        {
            "task": {
                "name": "dyck1",
                "formulation": "next_char",
                "max_train_length": 8,
                "train_size": 64,
                "valid_size": 16,
            },
            "model": {"kind": "decoder_only", "layers": 1, "d_model": 16, "heads": 2, "d_ff": 32, "dropout": 0.0},
        }
    )
    task = get_task("dyck1", **experiment.task_options)
    assert MODEL_FOR_TASK_KIND[task.kind] == "decoder_only"
    model = build_model(model_config_for_task(experiment, task))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    examples = task.train()
    batches = list(make_batches(examples, 16, pad_id=0, bos_id=1, eos_id=2, shuffle=False))

    def mean_loss() -> float:
        with torch.no_grad():
            parts = [OBJECTIVES["decoder_only"](model, b, None, 0, 0.0) for b in batches]
        return float(sum(p.total for p in parts) / sum(p.count for p in parts))

    before = mean_loss()
    for _ in range(25):
        for batch in batches:
            parts = OBJECTIVES["decoder_only"](model, batch, None, 0, 0.0)
            optimizer.zero_grad()
            (parts.total / parts.count).backward()
            optimizer.step()
    assert mean_loss() < 0.3 * before
    assert evaluate(model, task, "train", kind="decoder_only")["token_accuracy"] > 0.9


def test_a_next_char_task_needs_a_decoder_only_model():
    experiment = ExperimentConfig.from_dict(
        {"task": {"name": "parity", "formulation": "next_char"}, "model": {"kind": "encoder_classifier"}}
    )
    with pytest.raises(ConfigError, match="task 'parity' \\(task.formulation = 'next_char'\\) trains a decoder_only"):
        model_config_for_task(experiment, get_task("parity", formulation="next_char"))
    with pytest.raises(ConfigError, match="task.formulation: unknown 'lm'"):
        get_task("parity", formulation="lm")


# ---- length bins ---------------------------------------------------------------------------------


@pytest.mark.parametrize("formulation", ["classify", "next_char"])
def test_length_bins_are_disjoint_splits_with_lengths_in_range(formulation):
    bins = [[9, 12], [13, 16], [20, 30]]
    task = RecognitionTask(
        language="dyck1",
        formulation=formulation,
        max_train_length=8,
        length_generalisation_size=40,
        eval_lengths=bins,
    )
    names = ["length_9_12", "length_13_16", "length_20_30"]
    assert task.split_names()[-3:] == tuple(names)
    strings = {}
    for name, (low, high) in zip(names, bins):
        examples = task.split(name)
        assert len(examples) == 40
        assert all(low <= e.length <= high and len(task.string_of(e)) == e.length for e in examples)
        strings[name] = {task.string_of(e) for e in examples}
    for a, b in itertools.combinations(names, 2):
        assert not strings[a] & strings[b]
    assert task.split("length_9_12") == task.split("length_9_12")  # seeded


@pytest.mark.parametrize(
    ("bins", "message"),
    [
        ([[8, 12]], r"eval_lengths: bin 1 \[8, 12\] must start above 8 \(max_train_length=8\)"),
        ([[10, 9]], r"eval_lengths: bin 1 \[10, 9\] is empty"),
        ([[9, 12], [12, 20]], r"eval_lengths: bin 2 \[12, 20\] must start above 12"),
        ([[13, 20], [9, 12]], r"eval_lengths: bin 2 \[9, 12\] must start above 20"),
        ([[9]], r"eval_lengths: bin 1 is \[9\]; expected a pair"),
        ([[9, "x"]], r"eval_lengths: bin 1 is \[9, 'x'\]; expected a pair"),
    ],
)
def test_bad_length_bins_are_one_line_errors_naming_the_field(bins, message):
    with pytest.raises(ConfigError, match=f"task.{message}"):
        get_task("dyck1", max_train_length=8, eval_lengths=bins)


def test_a_bin_without_members_and_an_unknown_split_are_clear_errors():
    task = RecognitionTask(language="anbncn", max_train_length=6, eval_lengths=[[7, 8]])
    with pytest.raises(ConfigError, match=r"eval_lengths: anbncn has no string with a length in \[7, 8\]"):
        task.split("length_7_8")
    with pytest.raises(ConfigError, match="unknown split 'length_9_9'"):
        task.split("length_9_9")


# ---- balanced Dyck negatives ----------------------------------------------------------------------


def _balanced(s: str) -> bool:
    return all(s.count(a) == s.count(b) for a, b in ("()", "[]"))


@pytest.mark.parametrize("language", ["dyck1", "dyck2"])
@pytest.mark.parametrize("name", ["train", "test", "length_generalisation"])
def test_at_least_half_the_dyck_negatives_have_balanced_counts_and_none_is_a_member(language, name):
    task = RecognitionTask(language=language, max_train_length=12, train_size=400, test_size=101, seed=2)
    examples = task.split(name)
    negatives = [task.string_of(e) for e in examples if e.label == 0]
    assert negatives and not any(ORACLES[language](s) for s in negatives)
    assert sum(map(_balanced, negatives)) >= math.ceil(len(negatives) / 2)


# ---- statistics and baselines ---------------------------------------------------------------------


def test_split_statistics_count_examples_distinct_strings_and_positives():
    examples = [Example(source=(3, 4, 2), label=1), Example(source=(3, 4, 2), label=1), Example(source=(4, 2), label=0)]
    assert split_statistics(examples) == {
        "examples": 3,
        "distinct_strings": 2,
        "positives": 2,
        "distinct_positives": 1,
    }


def test_baselines_equal_hand_computed_values():
    strings = ["()", ")(", "(()", "()()", "))(("]
    labels = [1, 0, 0, 1, 0]
    # balanced counts predicts 1, 1, 0, 1, 1: right on 3 of 5; the majority label 0 is right on 3.
    assert baseline_accuracy("dyck1", strings, labels, majority=0) == {
        "baseline": "balanced_counts",
        "baseline_accuracy": 0.6,
        "majority_accuracy": 0.6,
    }
    # "([)]" is balanced (wrongly accepted), "[]" accepted, "(]" unbalanced (rightly refused)
    dyck2 = baseline_accuracy("dyck2", ["([)]", "[]", "(]"], [0, 1, 0], majority=1)
    assert dyck2["baseline_accuracy"] == pytest.approx(2 / 3)
    # "ba" has equal counts (wrongly accepted), "aab" not (rightly refused)
    anbn = baseline_accuracy("anbn", ["ab", "ba", "aab"], [1, 0, 0], majority=1)
    assert anbn["baseline_accuracy"] == pytest.approx(2 / 3)
    parity = baseline_accuracy("parity", ["11", "1"], [1, 0], majority=1)
    assert parity == {"baseline": "chance", "baseline_accuracy": 0.5, "majority_accuracy": 0.5}


def test_the_split_report_of_a_real_split_matches_a_recount():
    task = RecognitionTask(language="dyck1", max_train_length=12, train_size=40, test_size=200, seed=4)
    examples = task.test()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttnlabWarning)
        report = task.split_report("test", examples)
    strings = [task.string_of(e) for e in examples]
    labels = [e.label for e in examples]
    assert report["distinct_strings"] == len(set(strings))
    assert report["positives"] == sum(labels) == 100
    assert report["distinct_positives"] == len({s for s, y in zip(strings, labels) if y})
    by_hand = sum((s.count("(") == s.count(")")) == bool(y) for s, y in zip(strings, labels)) / len(strings)
    assert report["baseline_accuracy"] == pytest.approx(by_hand)
    assert by_hand <= 0.75 + 1e-9  # a balanced negative fools the count: at most 1 - 0.5 * 0.5
    assert report["majority_accuracy"] == 0.5


def test_a_held_out_split_with_few_distinct_strings_is_warned_about():
    task = RecognitionTask(language="dyck1", max_train_length=6, train_size=40, valid_size=50)
    with pytest.warns(AttnlabWarning, match="valid split holds only .* distinct strings"):
        task.split_report("valid", task.valid())
    # dyck1 up to 12 symbols: 196 members, so a test split of 400 draws ~20 distinct positives
    test = RecognitionTask(language="dyck1", max_train_length=12, train_size=40, test_size=400)
    with pytest.warns(AttnlabWarning, match=r"test split holds only \d+ distinct positive strings \(fewer than 25\)"):
        report = test.split_report("test", test.test())
    assert report["distinct_strings"] >= 100 and report["distinct_positives"] < 25
    wide = RecognitionTask(language="dyck2", max_train_length=12, train_size=40, test_size=400)
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        wide.split_report("test", wide.test())  # 400 draws from thousands of strings: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", AttnlabWarning)
        task.split_report("train", task.train())  # training is not a reported accuracy


def test_eval_prints_the_baseline_on_the_accuracy_line(capsys):
    from attnlab.cli.evaluate import _echo_metrics

    metrics = {
        "split": "test",
        "accuracy": 0.9,
        "baseline": "balanced_counts",
        "baseline_accuracy": 0.75,
        "majority_accuracy": 0.5,
        "positives": 10,
    }
    _echo_metrics(metrics, as_json=False)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "split: test",
        "accuracy: 0.9000 (baseline balanced_counts: 0.7500, majority class: 0.5000)",
        "positives: 10",
    ]


@pytest.mark.parametrize("language", ["dyck1", "dyck2"])
def test_few_balanced_negatives_are_dealt_so_every_split_has_some_and_none_is_shared(language):
    """At a small L the balanced-count negatives are few: they are dealt to the splits (as few
    positives are), so valid and test get some, and a near-miss drawn for another split never
    repeats one (no string in two splits)."""
    from attnlab.tasks import get_task

    task = get_task(language, max_train_length=6, train_size=300, valid_size=8, test_size=8,
                    length_generalisation_size=4)  # fmt: skip
    strings = {name: {e.source for e in task.split(name)} for name in ("train", "valid", "test")}
    assert not (
        strings["train"] & strings["valid"] or strings["train"] & strings["test"] or strings["valid"] & strings["test"]
    )
    for name in ("valid", "test"):
        negatives = [e for e in task.split(name) if e.label == 0]
        texts = ["".join(task.vocab.tokens[i] for i in e.source[:-1]) for e in negatives]  # EOS dropped
        assert len([t for t in texts if _is_balanced(t, language)]) >= len(negatives) / 2 > 0
        assert any(t in task._dealt_balanced for t in texts) == (language == "dyck1")  # dyck2's are many: hashed
        assert all(task._dealt_balanced.get(t) in (None, name) for t in texts)


def _is_balanced(string: str, language: str) -> bool:
    pairs = ["()"] if language == "dyck1" else ["()", "[]"]
    return all(string.count(a) == string.count(b) for a, b in pairs)
