"""Fine-tuning a run's model with some heads held off: the retraining step of pruning.

Michel et al. (2019) prune heads by masking them (xi_h = 0 in MHAtt(x, q) = sum_h xi_h Att_h(x, q))
and measure what is left; ``attnlab heads prune --retrain-steps N`` also lets the rest of the model
adapt before measuring: N optimisation steps on the run's train split with the pruned heads' xi_h
kept at 0. A head with xi_h = 0 contributes nothing to the output, so the gradient reaching its
rows of W_Q, W_K, W_V and its columns of W^O is exactly 0: with Adam (no weight decay) those
weights do not move, and the head stays off because the same mask is used to measure.

The optimiser is the run's (:func:`attnlab.training.trainer.make_optimizer`: Adam, or AdamW with
``train.weight_decay``) at a constant rate ``train.lr`` (the peak of the run's schedule), with its
label smoothing, gradient clipping and batch size; the batches are the run's train split in the
order ``train.seed`` gives (:class:`attnlab.training.data.BatchStream`), and dropout draws from
``torch.manual_seed(train.seed)``, so a fine-tuning repeats exactly.

A non-finite loss or gradient stops the fine-tuning before its update (the trainer refuses a
diverged step the same way): the pruning curve is never measured on NaN weights.
"""

from __future__ import annotations

import torch

from attnlab.devices import model_device
from attnlab.errors import UsageError
from attnlab.evaluation.objectives import OBJECTIVES
from attnlab.limits import MAX_STEPS
from attnlab.nn import HeadMask
from attnlab.run.loaded import LoadedRun
from attnlab.training.data import BatchStream
from attnlab.training.distributed import DistInfo
from attnlab.training.trainer import TrainingDiverged, make_optimizer

__all__ = ["fine_tune"]


def fine_tune(loaded: LoadedRun, head_mask: HeadMask | None, steps: int) -> list[float]:
    """Train ``loaded.model`` in place for ``steps`` steps on its train split under ``head_mask``.

    Args:
        loaded: the run; its model is changed in place and left in eval mode.
        head_mask: the heads to hold off (0) while training, e.g. the pruned and held heads.
        steps: optimisation steps (0: nothing happens).

    Returns:
        The loss of each step (the batch's mean over its predictions).

    Raises:
        UsageError: ``steps`` negative or past :data:`~attnlab.limits.MAX_STEPS`, or a task with no
            training examples.
        TrainingDiverged: a step's loss or gradient is not finite (the model keeps the weights of
            the step before).
    """
    if not 0 <= steps <= MAX_STEPS:
        raise UsageError(f"--retrain-steps: must lie in [0, {MAX_STEPS:,}] (attnlab.limits.MAX_STEPS), got {steps:,}")
    if steps == 0:
        return []
    cfg = loaded.experiment.train
    task, model = loaded.task, loaded.model
    examples = task.split("train")
    if not examples:
        raise UsageError("--retrain-steps: this run's task has no train split to fine-tune on")
    stream = BatchStream(
        examples,
        cfg.batch_size,
        pad_id=task.pad_id,
        bos_id=task.bos_id,
        eos_id=task.eos_id,
        seed=cfg.seed,
        max_length=cfg.max_length or model.config.max_len,
        truncate=cfg.truncate,
        dist=DistInfo(),
    )
    objective = OBJECTIVES[loaded.experiment.model_kind]
    optimizer = make_optimizer(model.parameters(), cfg)
    device = model_device(model)
    torch.manual_seed(cfg.seed)
    losses = []
    model.train()
    try:
        for step in range(1, steps + 1):
            batch = stream.next().to(device)
            parts = objective(model, batch, head_mask, task.pad_id, cfg.label_smoothing)
            loss = parts.total / parts.count.clamp_min(1)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            # max_norm = inf measures the gradient's norm and scales by 1: no clipping
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_norm or float("inf"))
            if not (torch.isfinite(loss) and torch.isfinite(norm)):
                raise TrainingDiverged(
                    f"--retrain-steps: fine-tuning step {step} of {steps} gave loss {float(loss)} and gradient "
                    f"norm {float(norm)}; its update was not applied. Lower train.lr (the run's peak rate, "
                    "used throughout the fine-tuning) or --retrain-steps"
                )
            optimizer.step()
            losses.append(float(loss.detach()))
    finally:
        model.eval()
        optimizer.zero_grad(set_to_none=True)
    return losses
