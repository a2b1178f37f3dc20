"""Losses and metrics of a model on a task, shared by training, head analysis, the viewer and benchmarks."""

from attnlab.evaluation.evaluate import evaluate
from attnlab.evaluation.objectives import OBJECTIVES, LossParts

__all__ = ["evaluate", "OBJECTIVES", "LossParts"]
