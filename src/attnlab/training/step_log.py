"""What the training loop logs: one step's outcome, the window of steps since the last log line,
and a split's one-line description.

A step line of ``metrics.jsonl`` holds ``loss`` = (1/n) sum_s L_s, the mean of the n per-step losses
since the previous line (each L_s its batch's mean over the tokens or examples it predicts), not the
last batch's: batches are grouped by length, so one batch can be far from the run's average; and
the rate of predictions per second over the window: ``examples_per_s`` for a classifier (one
prediction per example), ``tokens_per_s`` otherwise.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from attnlab.nn import MODELS

__all__ = ["StepOutcome", "LogWindow", "rate_key", "describe_split"]


@dataclass(frozen=True)
class StepOutcome:
    """One optimisation step: its mean loss, the tokens (or examples) it counted, its learning rate."""

    loss: float
    tokens: int
    lr: float


def rate_key(model_kind: str) -> str:
    """The throughput key of a step record (:attr:`~attnlab.nn.TransformerConfig.throughput_key`):
    a classifier predicts one label per example."""
    return MODELS[model_kind][0].throughput_key


@dataclass
class LogWindow:
    """The steps since the last log: their losses and predictions, and when the window began.

    ``record()`` gives ``loss`` = the mean of the steps' losses, (1/n) sum_s L_s, and the rate of
    predictions per second (``rate_key``: tokens, or examples for a classifier) over the window.
    """

    rate_key: str
    loss_sum: float = 0.0
    steps: int = 0
    predictions: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, outcome: StepOutcome) -> None:
        self.loss_sum += outcome.loss
        self.steps += 1
        self.predictions += outcome.tokens

    def record(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return {"loss": self.loss_sum / max(1, self.steps), self.rate_key: self.predictions / elapsed}


def describe_split(name: str, statistics: dict[str, int]) -> str:
    """``train split: 4000 examples, 3120 distinct strings, 2000 positives (1500 distinct)``."""
    line = f"{name} split: {statistics['examples']} examples, {statistics['distinct_strings']} distinct strings"
    if statistics["positives"]:
        line += f", {statistics['positives']} positives ({statistics['distinct_positives']} distinct)"
    return line
