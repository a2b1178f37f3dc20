"""attnlab.sweep.plan: grids, seeds, run names and [sweep] tables; every run checked by the
trainer's checks before anything is written."""

from __future__ import annotations

import os
import re

import pytest

from attnlab.errors import ConfigError, UsageError
from attnlab.experiment import load_experiment
from attnlab.sweep.plan import parse_grid, parse_seeds, plan_sweep, run_names
from tests.unit.sweep.tiny import GRID, TINY


@pytest.mark.parametrize(
    ("grid", "error", "message"),
    [
        (["model.nonsense=1,2"], ConfigError, r"^--grid model\.nonsense=1: model\.nonsense: unknown key"),
        (["model.positional=sinusoidal,rotary"], ConfigError, r"^--grid model\.positional=rotary: model\.positional"),
        (["model.heads=2,3"], ConfigError, r"^--grid model\.heads=3: model\."),
        (["train.steps=4,0"], ConfigError, r"^--grid train\.steps=0: train\.steps: must be >= 1"),
        (
            ["task.eval_lengths=[[9, 12]],[[9, 2000]]"],
            ConfigError,
            r"^--grid task\.eval_lengths=\[\[9, 2000\]\]: task\.eval_lengths: the longest bin needs 2001 positions",
        ),
        (["task.seed=1,2"], UsageError, r"^--grid task\.seed: seeds are set by --seeds"),
        (["modelheads=2"], UsageError, r"expected section\.key=value1,value2"),
        (["model.heads=2,,4"], UsageError, r"an empty value"),
        (["model.heads=2,2"], UsageError, r"the value 2 is given twice"),
        (["model.heads=2", "model.heads=4"], UsageError, r"the key is given twice"),
    ],
)
def test_a_bad_grid_is_one_error_before_anything_is_written(config, tmp_path, grid, error, message):
    with pytest.raises(error, match=message) as caught:
        plan_sweep(config, grid, "0")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "sweep").exists()


def test_a_combination_refused_only_together_names_the_run(config):
    # The config has 2 heads of d_model 8: 4 heads, and d_model 6, are each fine alone, not together.
    with pytest.raises(ConfigError, match=r"^run model\.heads-4_model\.d_model-6_seed-0: model\.") as caught:
        plan_sweep(config, ["model.heads=2,4", "model.d_model=8,6"], "0")
    assert "\n" not in str(caught.value)


def test_seeds_and_grid_values_parse():
    assert parse_seeds("0-4") == (0, 1, 2, 3, 4)
    assert parse_seeds("3,0-1, 7") == (3, 0, 1, 7)
    for bad in ("", "a", "4-2", "1,1", "-1", str(2**63), "9" * 5_000, f"0-{2**63}"):
        with pytest.raises(UsageError, match="--seeds"):
            parse_seeds(bad)
    (axis,) = parse_grid(['task.eval_lengths=[[5, 8], [9, 12]],[[5, 6]],"a,b",1e-3,true'])
    assert axis.values == ([[5, 8], [9, 12]], [[5, 6]], "a,b", 1e-3, True)
    assert axis.labels == ("[[5, 8], [9, 12]]", "[[5, 6]]", '"a,b"', "1e-3", "true")


def test_run_names_are_readable_and_distinct_with_every_grid_key_in_full():
    axes = parse_grid(["model.positional=sinusoidal,none", 'task.text="a b","a/b"', "model.seed=1"])
    combos = [(p, t, "1") for p in axes[0].labels for t in axes[1].labels]
    names = run_names(axes, combos, [0, 1])
    assert names[:2] == [
        "model.positional-sinusoidal_task.text-a_b-0_model.seed-1_seed-0",
        "model.positional-sinusoidal_task.text-a_b-0_model.seed-1_seed-1",
    ]
    assert names[2] == "model.positional-sinusoidal_task.text-a_b-1_model.seed-1_seed-0"
    # task.name is named as the grid key it is, not as a "name" that could be any section's.
    (task,) = parse_grid(["task.name=dyck1"])
    assert run_names([task], [("dyck1",)], [3]) == ["task.name-dyck1_seed-3"]
    assert len(set(names)) == len(names) == 8
    assert all(re.fullmatch(r"[A-Za-z0-9._-]+", name) and len(name) < os.pathconf("/", "PC_NAME_MAX") for name in names)


def test_a_seed_whose_validation_split_cannot_be_drawn_is_refused_before_training(config):
    # Parity up to length 4 has few strings; with task.seed = 2 the leak-free valid split of 24
    # cannot be filled. The end-of-training evaluation would find it only after the last step.
    with pytest.raises(ConfigError, match=r"^run seed-2: parity: could not draw a valid string"):
        plan_sweep(config, [], "1-2", ["task.max_train_length=4"])
    # The same for the test split, which the sweep scores after the last step (train.final_splits).
    with pytest.raises(ConfigError, match=r"^run seed-0: parity: could not draw a test string"):
        plan_sweep(config, [], "0-1", ["task.max_train_length=4"])
    with pytest.raises(ConfigError, match=r"^run seed-0: train\.final_splits: unknown split 'tset'; this task has"):
        plan_sweep(config, [], "0", ['train.final_splits=["tset"]'])


SWEEP_TABLE = """
[sweep]
seeds = "0-1"
[sweep.grid]
"model.attention" = ["soft", "hard"]
"model.positional" = ["sinusoidal", "none"]
"""


def test_a_sweep_table_in_the_file_plans_what_the_same_flags_plan(config, tmp_path):
    path = tmp_path / "with_sweep.toml"
    path.write_text(TINY + SWEEP_TABLE)
    from_file, from_flags = plan_sweep(path, [], None), plan_sweep(config, GRID, "0-1")
    assert [run.name for run in from_file.runs] == [run.name for run in from_flags.runs]
    assert [run.config for run in from_file.runs] == [run.config for run in from_flags.runs]
    assert from_file.seeds == (0, 1) and "sweep" not in from_file.tables
    # --grid replaces one key of the file's grid, --seeds its seeds; a new key comes last.
    plan = plan_sweep(path, ["model.positional=learned", "train.lr=0.01,0.02"], "3")
    assert plan.keys == ["model.attention", "model.positional", "train.lr"]
    assert {run.seed for run in plan.runs} == {3} and len(plan.runs) == 4
    assert {run.config["model"]["positional"] for run in plan.runs} == {"learned"}
    # attnlab train reads the base config: the [sweep] table is not part of an experiment.
    assert load_experiment(path).to_dict() == load_experiment(config).to_dict()


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("[sweep]\ngrids = 1\n", r"\[sweep\] grids: unknown key; allowed: grid, seeds"),
        ('[sweep]\nseeds = "4-2"\n', r"\[sweep\] seeds: "),
        ("[sweep]\nseeds = 3\n", r'\[sweep\] seeds: expected a string such as "0-4"'),
        ('[sweep.grid]\n"model.heads" = []\n', r'\[sweep\] grid\."model\.heads": expected a non-empty list'),
        ('[sweep.grid]\n"model.heads" = 2\n', r'\[sweep\] grid\."model\.heads": expected a non-empty list'),
        ('[sweep.grid]\n"model.heads" = [2, 2]\n', r"the value 2 is given twice"),
        ("[sweep.grid]\nheads = [2, 4]\n", r'grid\.heads: expected a quoted "section\.key"'),
        ('[sweep.grid]\n"task.seed" = [1, 2]\n', r"seeds are set by \[sweep\] seeds"),
        ('[sweep.grid]\n"model.heads" = [2, 3]\n', r"^\[sweep\] grid model\.heads=3: model\."),
    ],
)
def test_a_bad_sweep_table_is_one_error_naming_it(tmp_path, table, message):
    path = tmp_path / "bad.toml"
    path.write_text(TINY + table)
    with pytest.raises(ConfigError, match=message) as caught:
        plan_sweep(path, [], None)
    assert "\n" not in str(caught.value)
