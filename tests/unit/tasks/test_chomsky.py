"""The Chomsky-hierarchy tasks (Delétang et al. 2023): answers against independent references,
input sets against brute force, lengths, splits, seeds, the paper's metric, and tiny models that learn."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from attnlab.errors import ConfigError
from attnlab.evaluation.evaluate import evaluate
from attnlab.evaluation.metrics import accuracy_by_length, token_accuracy_per_sequence
from attnlab.evaluation.objectives import OBJECTIVES
from attnlab.experiment import ExperimentConfig, load_experiment, model_config_for_task, model_for_task
from attnlab.generate.search import DecodeOptions, decode
from attnlab.run.loaded import open_run
from attnlab.tasks import get_task, make_batches
from attnlab.tasks.chomsky import CHOMSKY_TASKS, LEVELS
from attnlab.tasks.codec import TextCodec
from attnlab.tasks.registry import TASKS, build_task

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
SPLITS = ("train", "valid", "test", "length_generalisation")
SMALL = dict(max_train_length=7, train_size=150, valid_size=30, test_size=30, length_generalisation_size=30, seed=3)


def _symbols(task, ids):
    return [task.vocab.tokens[i] for i in ids]


def _input(task, example):
    assert example.source[-1] == task.eos_id
    return _symbols(task, example.source[:-1])


# ---- independent references: each answer recomputed another way -----------------------------------


def _even_pairs(s):
    text = "".join(s)
    return len(re.findall("(?=01|10)", text)) % 2  # overlapping matches of an unequal pair


def _cycle(s):
    position = 0
    for move in s:
        position = {"0": position, "+": (position + 1) % 5, "-": (position - 1) % 5}[move]
    return position


def _modular(s):
    return eval("".join(s)) % 5  # Python's own precedence and integers; % 5 is in 0..4 for negatives too


def _stack(s):
    stack = ""  # a string, top at the end
    for symbol in s:
        if symbol in "01":
            stack += symbol
        elif symbol == "POP":
            stack = stack[:-1]
        else:
            stack += {"PUSH0": "0", "PUSH1": "1"}[symbol]
    return list(stack[::-1])


def _binary(operator):
    def solve(s):
        a, b = "".join(s).split(operator)
        value = int(a[::-1], 2) + int(b[::-1], 2) if operator == "+" else int(a[::-1], 2) * int(b[::-1], 2)
        return list(bin(value)[2:][::-1])

    return solve


REFERENCES = {
    "even_pairs": _even_pairs,
    "cycle_navigation": _cycle,
    "modular_arithmetic": _modular,
    "reverse_string": lambda s: s[::-1],
    "stack_manipulation": _stack,
    "duplicate_string": lambda s: s + s,
    "binary_addition": _binary("+"),
    "binary_multiplication": _binary("*"),
}


def _well_formed(name, s):
    """Whether ``s`` is an input the task can draw (written apart from the generators)."""
    text = " ".join(s)
    if name in ("even_pairs", "reverse_string", "duplicate_string"):
        return re.fullmatch(r"[01]( [01])*", text) is not None
    if name == "cycle_navigation":
        return re.fullmatch(r"[0+-]( [0+-])*", text) is not None
    if name == "modular_arithmetic":
        return re.fullmatch(r"[0-4]( [-+*] [0-4])*", text) is not None
    if name == "stack_manipulation":  # one bit alone, or a stack of bits then at least one action
        return len(s) == 1 and s[0] in "01" or re.fullmatch(r"[01]( [01])*( (POP|PUSH0|PUSH1))+", text) is not None
    operator = {"binary_addition": "+", "binary_multiplication": "*"}[name]
    match = re.fullmatch(rf"([01 ]+) \{operator} ([01 ]+)", text)
    return match is not None and all("1" in part for part in match.groups())  # operands >= 1


def test_every_task_is_registered_with_its_model_and_level():
    assert set(CHOMSKY_TASKS) == set(REFERENCES)
    for name, cls in CHOMSKY_TASKS.items():
        model = "encoder_classifier" if cls.level == "regular" else "encoder_decoder"
        assert TASKS[name].model_kind == model
    assert [cls.level for cls in CHOMSKY_TASKS.values()] == ["regular"] * 3 + ["dcf"] * 2 + ["cs"] * 3


def test_defaults_are_the_papers_training_lengths():
    for name in CHOMSKY_TASKS:
        task = get_task(name)
        assert task.max_train_length == 40
        assert task.lengths("train") == range(1, 41) and task.lengths("length_generalisation") == range(41, 81)
    assert get_task("modular_arithmetic").num_classes == 5 and get_task("cycle_navigation").num_classes == 5
    assert get_task("even_pairs").num_classes == 2


@pytest.mark.parametrize("name", sorted(CHOMSKY_TASKS))
def test_answers_equal_an_independent_reference(name):
    task = get_task(name, **SMALL)
    for split in SPLITS:
        for example in task.split(split):
            s = _input(task, example)
            assert _well_formed(name, s), s
            expected = REFERENCES[name](s)
            if task.kind == "classification":
                assert example.label == expected and example.target is None
                assert 0 <= example.label < task.num_classes
            else:
                assert _symbols(task, example.target) == expected and example.label is None


def test_the_papers_examples():
    cycle, modular = get_task("cycle_navigation"), get_task("modular_arithmetic")
    assert cycle.solve(tuple("+-0--")) == 3 and cycle.solve(tuple("+++-")) == 2
    assert modular.solve(tuple("1+2*3")) == 2 and modular.solve(tuple("1-1-1")) == 4
    assert modular.solve(tuple("0*1+4*3-2")) == 0
    even = get_task("even_pairs")
    assert even.solve(tuple("001110")) == 0 and even.solve(tuple("0101001")) == 1
    stack = get_task("stack_manipulation")
    assert stack.solve(("0", "1", "1", "0", "PUSH1", "POP", "POP")) == ("1", "1", "0")
    assert stack.solve(("1", "1", "0", "POP", "POP", "POP")) == ()
    # Little-endian: 001 + 01101 = 4 + 22 = 26 -> 01011; 1001 + 000001 = 9 + 32 = 41 -> 100101.
    assert "".join(get_task("binary_addition").solve(tuple("001+01101"))) == "01011"
    assert "".join(get_task("binary_addition").solve(tuple("1001+000001"))) == "100101"
    assert "".join(get_task("binary_multiplication").solve(tuple("001*01101"))) == "0001101"  # 88
    assert "".join(get_task("binary_multiplication").solve(tuple("1001*000001"))) == "000001001"  # 288


@pytest.mark.parametrize("name", sorted(CHOMSKY_TASKS))
def test_input_counts_equal_brute_force(name):
    task = get_task(name)
    alphabet = task.vocab.tokens[3:]
    for n in range(1, 6):
        count = sum(_well_formed(name, s) for s in itertools.product(alphabet, repeat=n))
        assert task.num_distinct(n) == count, (name, n)


@pytest.mark.parametrize("name", sorted(CHOMSKY_TASKS))
def test_lengths_in_range_and_splits_disjoint(name):
    task = get_task(name, **SMALL)
    splits = {split: task.split(split) for split in SPLITS}
    shortest = 3 if name.startswith("binary") else 1
    for split, examples in splits.items():
        assert len(examples) == SMALL[f"{split}_size"]
        for example in examples:
            assert len(example.source) - 1 == example.length
            low, high = (8, 14) if split == "length_generalisation" else (shortest, 7)
            assert low <= example.length <= high
            if name == "modular_arithmetic":
                assert example.length % 2 == 1
    sources = {split: {e.source for e in examples} for split, examples in splits.items()}
    for a, b in itertools.combinations(("train", "valid", "test"), 2):
        assert not sources[a] & sources[b], (a, b)
    # Lengths are drawn uniformly: every length that has inputs appears (30 draws over <= 7 lengths).
    assert {e.length for e in splits["length_generalisation"]} == {n for n in range(8, 15) if task.num_distinct(n)}


def test_reproducible_by_seed():
    for name in CHOMSKY_TASKS:
        first = get_task(name, **SMALL).split("train")
        assert first == get_task(name, **SMALL).split("train")
        assert first != get_task(name, **{**SMALL, "seed": 4}).split("train")


def test_bad_options_name_the_key():
    with pytest.raises(ConfigError, match=r"^task\.modulus: must lie in \[2, 10\], got 11"):
        get_task("modular_arithmetic", modulus=11)
    with pytest.raises(ConfigError, match=r"^task\.max_train_length: must be >= 3 .*got 2"):
        get_task("binary_addition", max_train_length=2)
    with pytest.raises(ConfigError, match=r"^task\.modulus: unknown option"):
        get_task("cycle_navigation", modulus=3)
    with pytest.raises(ConfigError, match=r"^task\.train_size"):
        get_task("even_pairs", train_size="many")


@pytest.mark.parametrize("level", LEVELS)
def test_one_example_config_per_level(level):
    experiment = load_experiment(CONFIGS / f"chomsky_{level}.toml")
    task, _ = build_task({**experiment.task, "train_size": 10, "valid_size": 2, "test_size": 2})
    assert task.level == level and task.max_train_length < 40  # small: for two CPU cores
    assert model_config_for_task(experiment, task).kind == TASKS[task.name].model_kind


def test_inputs_are_typed_as_symbols():
    stack = get_task("stack_manipulation")
    ids = TextCodec(stack, None).encode("0 1 1 0 PUSH1 POP POP")
    assert "".join(stack.solve(tuple(_symbols(stack, ids)))) == "110"
    binary = get_task("binary_addition")
    assert TextCodec(binary, None).decode(TextCodec(binary, None).encode("001+01101")) == "001+01101"


def test_a_classification_task_sizes_the_classifier():
    for name, classes in (("cycle_navigation", 5), ("even_pairs", 2), ("modular_arithmetic", 7)):
        options = {"modulus": 7} if name == "modular_arithmetic" else {}
        experiment = ExperimentConfig.from_dict(
            {"task": {"name": name, **options}, "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 8}}
        )
        task = get_task(name, **options)
        assert model_config_for_task(experiment, task).num_classes == classes


# ---- the paper's metric ---------------------------------------------------------------------------


def test_token_accuracy_per_sequence_weighs_sequences_alike():
    predictions = [[3, 4, 4], [3], [], [5, 5, 5, 5]]
    references = [[3, 4, 3], [3, 4, 4, 4], [], [5, 5]]
    assert token_accuracy_per_sequence(predictions, references) == [2 / 3, 1 / 4, 1.0, 1.0]
    assert token_accuracy_per_sequence([[3]], [[]]) == [0.0]
    assert accuracy_by_length([0.5, 1.0, 0.25], [2, 2, 3]) == {"2": 0.75, "3": 0.25}


def _tiny(name, kind, **task_options):
    experiment = ExperimentConfig.from_dict(
        {
            "task": {"name": name, **task_options},
            "model": {"kind": kind, "layers": 1, "d_model": 32, "heads": 2, "d_ff": 64, "dropout": 0.0},
        }
    )
    task = get_task(name, **task_options)
    return task, model_for_task(experiment, task)


@pytest.mark.parametrize("name", ["stack_manipulation", "reverse_string"])
def test_evaluate_reports_the_papers_metric_and_exact_match(name):
    task, model = _tiny(name, "encoder_decoder", **{**SMALL, "valid_size": 24})
    result = evaluate(model, task, "valid", kind="encoder_decoder", batch_size=7)
    examples = task.valid()
    sources = torch.nn.utils.rnn.pad_sequence([torch.tensor(e.source) for e in examples], batch_first=True)
    hypotheses = decode(
        model,
        sources,
        bos_id=1,
        eos_id=2,
        pad_id=0,
        options=DecodeOptions(max_length=max(len(e.target) for e in examples) + 2),
    )
    fractions, exact = [], []
    for hypothesis, example in zip(hypotheses, examples):
        reference, predicted = list(example.target), list(hypothesis.tokens)
        if name == "stack_manipulation":  # the terminator (EOS) is scored as the paper scores its own
            reference, predicted = reference + [2], predicted + [2] * hypothesis.finished
        right = sum(i < len(predicted) and predicted[i] == t for i, t in enumerate(reference))
        fractions.append(right / len(reference))
        exact.append(list(hypothesis.tokens) == list(example.target))
    assert result["accuracy"] == pytest.approx(sum(fractions) / len(fractions))
    assert result["token_accuracy_per_sequence"] == result["accuracy"]
    assert result["sequence_accuracy"] == pytest.approx(sum(exact) / len(exact))
    by_length = {}
    for fraction, example in zip(fractions, examples):
        by_length.setdefault(str(example.length), []).append(fraction)
    assert result["accuracy_by_length"] == pytest.approx({k: sum(v) / len(v) for k, v in by_length.items()})


# ---- tiny models learn ----------------------------------------------------------------------------


def _mean_loss(model, task, kind):
    batches = make_batches(task.train(), 64, pad_id=0, bos_id=1, eos_id=2, shuffle=False)
    with torch.no_grad():
        parts = [OBJECTIVES[kind](model, batch, None, 0, 0.0) for batch in batches]
    return float(sum(p.total for p in parts) / sum(p.count for p in parts))


@pytest.mark.parametrize(
    ("name", "kind", "steps"),
    [("cycle_navigation", "encoder_classifier", 100), ("reverse_string", "encoder_decoder", 60)],
)
def test_a_tiny_model_learns(name, kind, steps):
    task, model = _tiny(name, kind, max_train_length=5, train_size=256, valid_size=8, test_size=8)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    before = _mean_loss(model, task, kind)
    batches = itertools.cycle(list(make_batches(task.train(), 32, pad_id=0, bos_id=1, eos_id=2, seed=1)))
    for _ in range(steps):
        parts = OBJECTIVES[kind](model, next(batches), None, 0, 0.0)
        optimizer.zero_grad()
        (parts.total / parts.count).backward()
        optimizer.step()
    after = _mean_loss(model, task, kind)
    classes = task.num_classes if kind == "encoder_classifier" else task.vocab_size
    assert before > 0.8 * math.log(classes)  # starts near chance
    assert after < 0.5 * before, (before, after)


def test_attnlab_train_end_to_end(tmp_path):
    """`attnlab train` on a context-sensitive task: the run trains, reports the paper's metric on the
    validation split, and opens again to score the length-generalisation split."""
    config = tmp_path / "binary_addition.toml"
    config.write_text(
        '[task]\nname = "binary_addition"\nmax_train_length = 6\ntrain_size = 64\nvalid_size = 8\n'
        "test_size = 8\nlength_generalisation_size = 8\n"
        '[model]\nkind = "encoder_decoder"\nlayers = 1\nd_model = 16\nheads = 2\nd_ff = 32\n'
        "[train]\nsteps = 3\nbatch_size = 8\nlog_every = 1\nthreads = 1\n"
    )
    run = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread: two would only fight the other tests for the cores
    trained = subprocess.run(
        [sys.executable, "-m", "attnlab", "train", str(config), "--out", str(run), "--no-progress", "--json"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert trained.returncode == 0, trained.stderr
    valid = json.loads(trained.stdout)["valid"]
    assert valid["examples"] == 8 and valid["accuracy"] == valid["token_accuracy_per_sequence"]
    assert 0 <= valid["sequence_accuracy"] <= valid["accuracy"] <= 1
    loaded = open_run(run)
    assert loaded.experiment.task_name == "binary_addition"
    result = evaluate(loaded.model, loaded.task, "length_generalisation", kind="encoder_decoder")
    assert result["examples"] == 8 and set(result["accuracy_by_length"]) <= {str(n) for n in range(7, 13)}


def test_generate_names_a_class_not_membership(tmp_path, capsys):
    from attnlab.cli import main
    from attnlab.training.trainer import train

    sizes = dict(max_train_length=4, train_size=32, valid_size=4, test_size=4, length_generalisation_size=4)
    experiment = ExperimentConfig.from_dict(
        {
            "task": {"name": "cycle_navigation", **sizes},
            "model": {"kind": "encoder_classifier", "layers": 1, "d_model": 8, "heads": 2, "d_ff": 16},
            "train": {"steps": 2, "batch_size": 8, "log_every": 1},
        }
    )
    train(experiment, tmp_path / "run", progress=False)
    with pytest.raises(SystemExit) as ended:
        main(["generate", str(tmp_path / "run"), "+-0--"])
    assert ended.value.code == 0
    assert re.fullmatch(r"\+-0--\tclass [0-4] \(p=[01]\.\d{3}\)\n", capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(CHOMSKY_TASKS))
def test_fresh_training_batches_repeat_with_their_rng_and_hold_only_training_inputs(name):
    """task.fresh_examples (the paper's training): a batch is a function of its rng alone, with
    lengths 1..L, and never an input that valid or test owns."""
    import random

    from attnlab.tasks.base import split_of

    task = get_task(name, max_train_length=12, fresh_examples=True)
    batch = task.fresh_train(random.Random("0:fresh:3"), 32)
    assert batch == task.fresh_train(random.Random("0:fresh:3"), 32)
    assert batch != task.fresh_train(random.Random("0:fresh:4"), 32)
    assert all(1 <= e.length <= 12 for e in batch)
    assert all(split_of(task.seed, task.vocab.decode(e.source)) == "train" for e in batch)
