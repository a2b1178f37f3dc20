"""Every built-in task trains to its documented accuracy with its config in configs/ (slow).

The documented numbers are in docs/tasks.md ("What the configs reach"); each threshold below sits a
little under the measured value so that the test checks learning, not a particular seed's luck.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest

from tests.cli import attnlab as run_attnlab
from tests.toy_corpora import write_number_words

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

# config -> (split, minimum accuracy)
DOCUMENTED = {
    "copy": ("test", 0.97),
    "reverse": ("test", 0.97),
    "sort": ("test", 0.90),
    "addition": ("test", 0.92),
    "dyck1": ("test", 0.96),
    # Half of dyck2's negatives keep every bracket count balanced (wrong order only): test 0.8925
    # at seed 0 with them (0.93 was measured before, when nearly every negative changed a count).
    "dyck2": ("test", 0.87),
    "parity": ("test", 0.94),
    # a^n b^n and a^n b^n c^n have one positive string per n, and leak-free splits hold some n
    # out of training: the configs learn the training strings perfectly, and the test split
    # measures interpolation to unseen n, which these models do not achieve (docs/tasks.md).
    "anbn": ("train", 0.98),
    "anbncn": ("train", 0.98),
    # Delétang et al. 2023, one task per level; accuracy is the paper's per-sequence token accuracy.
    "chomsky_regular": ("test", 0.95),
    "chomsky_dcf": ("test", 0.95),
    "chomsky_cs": ("test", 0.95),
}


def attnlab(*args: str) -> subprocess.CompletedProcess[str]:
    return run_attnlab(*args, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_builtin_task_reaches_documented_accuracy(name, tmp_path):
    result = attnlab("train", str(CONFIGS / f"{name}.toml"), "--out", str(tmp_path / "run"), "--no-progress")
    assert result.returncode == 0, result.stderr[-2000:]
    split, minimum = DOCUMENTED[name]
    metrics = json.loads(attnlab("eval", str(tmp_path / "run"), "--split", split, "--json", "--no-progress").stdout)
    assert metrics["accuracy"] >= minimum, metrics


def _number_words(path: Path) -> None:
    write_number_words(path, 3000, seed=1, max_digits=6)


def _sentences(path: Path) -> None:
    rng = random.Random(1)
    subjects, verbs = ["the cat", "a dog", "my friend", "the teacher", "a bird"], ["sees", "likes", "finds", "follows"]
    objects = ["the ball", "a tree", "the river", "an apple"]
    path.write_text(
        "".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} .\n" for _ in range(3000))
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,make,metric,bound",
    [
        ("translation", _number_words, "bleu", 90.0),
        ("lm", _sentences, "perplexity", 3.0),
        ("lm_llama", _sentences, "perplexity", 3.0),
    ],
)
def test_text_tasks_learn_generated_data(name, make, metric, bound, tmp_path):
    data = tmp_path / ("train.tsv" if name == "translation" else "corpus.txt")
    make(data)
    result = attnlab(
        "train",
        str(CONFIGS / f"{name}.toml"),
        "--out",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        f'task.train_file="{data}"',
        "--set",
        "train.steps=800",
        "--set",
        "task.vocab_size=200",
    )
    assert result.returncode == 0, result.stderr[-2000:]
    metrics = json.loads(attnlab("eval", str(tmp_path / "run"), "--split", "test", "--json", "--no-progress").stdout)
    value = metrics[metric]
    assert value >= bound if metric == "bleu" else value <= bound, metrics
