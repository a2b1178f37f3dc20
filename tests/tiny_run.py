"""A tiny trained run for the integrity tests: a word-level language model, 4 steps, in process."""

from __future__ import annotations

import random
from pathlib import Path

from attnlab.experiment import ExperimentConfig
from attnlab.training.trainer import train

WORDS = "the cat sat on a mat dog ran far away big small red".split()


def tiny_experiment(folder: Path, *, steps: int = 4) -> ExperimentConfig:
    """An ``lm`` experiment on a 120-line corpus written into ``folder``: tokenizer.json included,
    dropout off (no random masks), a checkpoint every 2 steps."""
    corpus = folder / "train.txt"
    if not corpus.exists():
        rng = random.Random(0)
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 8))) for _ in range(120)]
        corpus.write_text("\n".join(lines) + "\n")
    return ExperimentConfig.from_dict(
        {
            "task": {"name": "lm", "train_file": str(corpus), "tokenizer_kind": "word", "vocab_size": 64},
            "model": {
                "kind": "decoder_only",
                "layers": 1,
                "d_model": 8,
                "heads": 2,
                "d_ff": 16,
                "max_len": 16,
                "dropout": 0.0,
            },
            "train": {"steps": steps, "batch_size": 8, "log_every": 1, "checkpoint_every": 2, "eval_every": 0},
        }
    )


def build_tiny_run(folder: Path) -> tuple[ExperimentConfig, Path]:
    """Train the tiny run into ``folder/run``; returns its experiment and path."""
    experiment = tiny_experiment(folder)
    train(experiment, folder / "run", progress=False)
    return experiment, folder / "run"
