"""Training curves as PNG: the loss and learning rate per step, and evaluation metrics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attnlab.figures import plt, save_figure

__all__ = ["plot_accuracy_by_length", "plot_curves"]


def plot_curves(records: Sequence[dict[str, Any]], folder: Path) -> list[Path]:
    """Write ``loss.png`` (training loss and LR) and ``accuracy.png`` (evaluation metrics).

    The curves follow the first split evaluated (``valid`` during training); the end-of-training
    evaluations of the length bins are plotted by :func:`plot_accuracy_by_length`.
    """
    written = []
    first = next((r["split"] for r in records if r.get("split")), None)
    records = [r for r in records if r.get("split") in (None, first)]
    steps = [r for r in records if "loss" in r and "split" not in r]
    if steps:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss")
        evals = [r for r in records if r.get("split") and "loss" in r]
        if evals:
            ax.plot([r["step"] for r in evals], [r["loss"] for r in evals], "o-", label=f"{evals[0]['split']} loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_yscale("log")
        lr_axis = ax.twinx()
        lr_axis.plot([r["step"] for r in steps], [r["lr"] for r in steps], color="grey", alpha=0.5, label="lr")
        lr_axis.set_ylabel("learning rate")
        ax.legend(loc="upper right")
        fig.tight_layout()
        written.append(save_figure(fig, folder / "loss.png", dpi=100))
    evals = [r for r in records if r.get("split")]
    keys = [k for k in ("accuracy", "sequence_accuracy", "token_accuracy") if any(k in r for r in evals)]
    if evals and keys:
        fig, ax = plt.subplots(figsize=(6, 4))
        for key in keys:
            points = [(r["step"], r[key]) for r in evals if key in r]
            ax.plot(*zip(*points), "o-", label=key)
        ax.set_xlabel("step")
        ax.set_ylabel(f"{evals[0]['split']} accuracy")
        ax.set_ylim(0, 1.02)
        ax.legend()
        fig.tight_layout()
        written.append(save_figure(fig, folder / "accuracy.png", dpi=100))
    return written


def plot_accuracy_by_length(results: Sequence[dict[str, Any]], folder: Path) -> Path:
    """Write ``accuracy_by_length.png``: accuracy against string length, one line per split.

    Args:
        results: evaluation results (:func:`attnlab.evaluation.evaluate`), each with ``split`` and
            ``accuracy_by_length``.
    """
    fig, ax = plt.subplots(figsize=(6, 4))
    for result in results:
        points = sorted((int(n), a) for n, a in result.get("accuracy_by_length", {}).items())
        if points:
            ax.plot(*zip(*points), "o-", markersize=3, label=result["split"])
    ax.set_xlabel("length")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.legend()
    fig.tight_layout()
    return save_figure(fig, folder / "accuracy_by_length.png", dpi=100)
