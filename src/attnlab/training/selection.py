"""Which weights a run reports, when it stops early, and the oracle report of Bhattamishra et al.

A run evaluates every ``train.eval_every`` steps; each evaluation is an :class:`Evaluation` (its
step, and the accuracy and loss of each split it scored). From that history:

* ``train.select`` (:data:`SELECTORS`) picks the weights the final evaluation scores: ``last``, the
  last step's; ``best_valid``, the evaluation with the highest ``valid`` accuracy, ties to the lower
  ``valid`` loss, then to the earlier step. The validation split holds training lengths, disjoint
  from train by string, never a length bin: a selection that looked at a test bin would report a
  maximum of noisy estimates, not an estimate of what a model trained this way does.
* ``train.stop_at_accuracy`` (:func:`stop_reached`): the mean accuracy over ``valid`` and the length
  bins reaches the threshold (Bhattamishra et al. stop at 0.999, over the same bins they report).
* the oracle report (:func:`oracle_report`): per length bin, the best accuracy over every evaluated
  step, acc*_b = max_s acc_b(s), which is what Bhattamishra et al. report ("max_val_acc_bin" in
  their code). It is selected on the test bins themselves, so it is biased upwards (the maximum
  of noisy estimates), and is reported apart from the run's figures, labelled :data:`ORACLE_LABEL`.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ORACLE_LABEL",
    "SELECTORS",
    "Evaluation",
    "Selection",
    "oracle_report",
    "select",
    "stop_reached",
]

ORACLE_LABEL = "selected on the test bins"
"""How every oracle figure is marked: the step behind it was chosen by looking at the bin it scores."""


@dataclass(frozen=True)
class Evaluation:
    """One evaluation during training: its step and, per split scored, accuracy and loss."""

    step: int
    accuracy: Mapping[str, float]
    loss: Mapping[str, float]

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "accuracy": dict(self.accuracy), "loss": dict(self.loss)}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Evaluation:
        return cls(int(data["step"]), dict(data["accuracy"]), dict(data["loss"]))


@dataclass(frozen=True)
class Selection:
    """The weights chosen (those of ``step``), by which rule, and why."""

    mode: str
    step: int
    reason: str

    def record(self) -> dict[str, Any]:
        """The fields a final evaluation carries: ``select``, ``selected_step``, ``selected_because``."""
        return {"select": self.mode, "selected_step": self.step, "selected_because": self.reason}


def _last(history: Sequence[Evaluation], last_step: int) -> Selection:
    return Selection("last", last_step, f"the last step's weights (step {last_step})")


def _best_valid(history: Sequence[Evaluation], last_step: int) -> Selection:
    scored = [e for e in history if "valid" in e.accuracy]
    if not scored:
        return Selection("best_valid", last_step, "no validation during training: the last step's weights")
    best = max(scored, key=lambda e: (e.accuracy["valid"], -e.loss.get("valid", 0.0), -e.step))
    steps = ", ".join(str(e.step) for e in scored)
    loss = best.loss.get("valid", float("nan"))
    return Selection(
        "best_valid",
        best.step,
        f"the highest valid accuracy ({best.accuracy['valid']:.4f}, valid loss {loss:.4g}) of {len(scored)} "
        f"evaluations (steps {steps}); ties go to the lower valid loss, then the earlier step",
    )


SELECTORS: dict[str, Callable[[Sequence[Evaluation], int], Selection]] = {
    "last": _last,
    "best_valid": _best_valid,
}
"""Registry: ``train.select`` -> selector(history, last_step) -> :class:`Selection`."""


def select(mode: str, history: Sequence[Evaluation], last_step: int) -> Selection:
    """The weights ``train.select = mode`` reports, from the evaluations ``history`` of a run that
    ended at ``last_step``."""
    return SELECTORS[mode](history, last_step)


def stop_reached(evaluation: Evaluation, threshold: float) -> float | None:
    """The mean accuracy over the splits ``evaluation`` scored when it reaches ``threshold``, else None."""
    mean = statistics.fmean(evaluation.accuracy.values())
    return mean if mean >= threshold else None


def oracle_report(history: Sequence[Evaluation], bins: Sequence[str]) -> dict[str, Any]:
    """Per length bin, the best accuracy over the evaluated steps and the first step reaching it.

    Returns:
        ``{"selected_on": ORACLE_LABEL, "evaluations": n, "steps": [...], "bins": {bin: {"accuracy":
        max_s acc_b(s), "step": s*}}}``; a bin never scored is left out.
    """
    report: dict[str, Any] = {
        "selected_on": ORACLE_LABEL,
        "what": "per bin, the best accuracy over the evaluated steps (Bhattamishra et al. 2020's figure); "
        "optimistic, never the run's result",
        "evaluations": len(history),
        "steps": [e.step for e in history],
        "bins": {},
    }
    for name in bins:
        scored = [e for e in history if name in e.accuracy]
        if scored:
            best = max(scored, key=lambda e: (e.accuracy[name], -e.step))
            report["bins"][name] = {"accuracy": best.accuracy[name], "step": best.step}
    return report
