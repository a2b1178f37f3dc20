"""What a training config is refused for before anything is built or written: a ``train.log_to``
target whose package is missing, a model or batch that cannot fit, a final split the task lacks or
cannot draw, and a loss the task's outputs do not take. :func:`attnlab.training.trainer.train` runs
them first; a sweep's plan runs them for every run before the first trains (:mod:`attnlab.sweep.plan`).
"""

from __future__ import annotations

from collections.abc import Sequence

from attnlab.errors import ConfigError
from attnlab.experiment import ExperimentConfig, TrainConfig, model_config_for_task
from attnlab.resources import check_length_bins_fit, check_training_resources
from attnlab.tasks.base import Example, Task, check_final_splits
from attnlab.training.tensorboard_log import require_tensorboard

__all__ = ["check_log_targets", "check_resources", "check_splits", "check_loss"]


def check_log_targets(cfg: TrainConfig) -> None:
    """Refuse a ``train.log_to`` target whose package is missing (TensorBoard's), before anything is
    built or written."""
    if "tensorboard" in cfg.log_to:
        require_tensorboard()


def check_resources(
    experiment: ExperimentConfig, task: Task, train_examples: Sequence[Example], *, available: int | None = None
) -> None:
    """Refuse a model or batch that cannot fit (layers, batch size, memory estimate), and length
    bins longer than the model reads (scored only at the end), before any of it is allocated; see
    :func:`attnlab.resources.check_training_resources` and ``check_length_bins_fit``.

    Args:
        available: bytes free on the training device (a GPU's); None on a CPU.
    """
    config = model_config_for_task(experiment, task)
    max_length = experiment.train.max_length or config.max_len
    check_training_resources(
        config,
        batch_size=experiment.train.batch_size,
        examples=train_examples,
        max_length=max_length,
        available=available,
    )
    check_length_bins_fit(task, max_length)


def check_splits(task: Task, final_splits: Sequence[str]) -> None:
    """Refuse a ``train.final_splits`` entry the task lacks, and draw the splits the end-of-training
    evaluation scores (``valid`` and ``final_splits``) now: a seed can make a small split of a small
    language impossible, which training would otherwise find only after its last step."""
    check_final_splits(task, final_splits)
    for name in ("valid", *final_splits):
        task.split(name)


def check_loss(loss: str, task: Task) -> None:
    """Refuse ``train.loss = "mse"`` for a task without per-symbol sigmoids (all but ``next_char``)."""
    if loss != "bce" and getattr(task, "kind", None) != "next_char":
        raise ConfigError(
            f"train.loss: {loss!r} applies to the per-symbol sigmoids of next_char recognition "
            f'(task.formulation = "next_char"); this task trains with cross-entropy, use "bce"'
        )
